//! A minimal JSON writer for the reports the faces print and the browser receives (the kernel
//! self-check, adapter info, the equivalence gates), and a reader for the one file the library
//! takes back: the PORTABLE gate's golden summary (`crate::golden`). Hand-written so the wasm
//! build needs no serde; the same text is what the native CLI writes and the page parses.
//!
//! Non-finite numbers have no JSON spelling: they are written as `null`, and every report that
//! can produce one also carries a pass/fail flag that says what happened.

use std::fmt::Write;

/// `s` as a JSON string literal, quotes included.
pub fn string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// `x` as a JSON number (shortest round-trip form, exponent notation for small and large
/// magnitudes), or `null` when it is NaN or infinite.
pub fn number(x: f64) -> String {
    if !x.is_finite() {
        return "null".into();
    }
    if x == x.trunc() && x.abs() < 1e15 {
        return format!("{x:.0}");
    }
    if (1e-3..1e6).contains(&x.abs()) {
        format!("{x}")
    } else {
        format!("{x:e}")
    }
}

/// Builds one JSON object, field by field, in insertion order.
#[derive(Debug, Default)]
pub struct Object {
    body: String,
}

impl Object {
    pub fn new() -> Self {
        Object::default()
    }

    /// A field whose value is already JSON text (a nested object or array).
    pub fn raw(mut self, key: &str, json: &str) -> Self {
        if !self.body.is_empty() {
            self.body.push(',');
        }
        self.body.push_str(&string(key));
        self.body.push(':');
        self.body.push_str(json);
        self
    }

    pub fn str(self, key: &str, value: &str) -> Self {
        self.raw(key, &string(value))
    }

    pub fn num(self, key: &str, value: f64) -> Self {
        self.raw(key, &number(value))
    }

    pub fn int(self, key: &str, value: u64) -> Self {
        self.raw(key, &value.to_string())
    }

    pub fn bool(self, key: &str, value: bool) -> Self {
        self.raw(key, if value { "true" } else { "false" })
    }

    pub fn finish(self) -> String {
        format!("{{{}}}", self.body)
    }
}

/// A JSON array of items that are already JSON text.
pub fn array<I: IntoIterator<Item = String>>(items: I) -> String {
    format!("[{}]", items.into_iter().collect::<Vec<_>>().join(","))
}

/// A parsed JSON value. Objects keep their fields in file order.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Null,
    Bool(bool),
    Number(f64),
    String(String),
    Array(Vec<Value>),
    Object(Vec<(String, Value)>),
}

#[derive(Debug, thiserror::Error, PartialEq)]
#[error("JSON at byte {at}: {message}")]
pub struct ParseError {
    pub at: usize,
    pub message: String,
}

impl Value {
    /// The field `key` of an object (None for other values or a missing key).
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Object(fields) => fields.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Number(x) => Some(*x),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(items) => Some(items),
            _ => None,
        }
    }
}

/// Parses one JSON document (RFC 8259; surrounding whitespace allowed).
pub fn parse(text: &str) -> Result<Value, ParseError> {
    let mut p = Parser { text: text.as_bytes(), at: 0 };
    let value = p.value(0)?;
    p.space();
    if p.at != p.text.len() {
        return Err(p.error("trailing characters after the document"));
    }
    Ok(value)
}

/// Nesting deeper than this is refused rather than risking the stack.
const MAX_DEPTH: usize = 64;

struct Parser<'t> {
    text: &'t [u8],
    at: usize,
}

impl Parser<'_> {
    fn error(&self, message: &str) -> ParseError {
        ParseError { at: self.at, message: message.to_string() }
    }

    fn space(&mut self) {
        while self.text.get(self.at).is_some_and(|c| c.is_ascii_whitespace()) {
            self.at += 1;
        }
    }

    fn eat(&mut self, c: u8) -> bool {
        self.space();
        let hit = self.text.get(self.at) == Some(&c);
        self.at += hit as usize;
        hit
    }

    fn literal(&mut self, word: &str, value: Value) -> Result<Value, ParseError> {
        if self.text[self.at..].starts_with(word.as_bytes()) {
            self.at += word.len();
            Ok(value)
        } else {
            Err(self.error("expected a value"))
        }
    }

    fn value(&mut self, depth: usize) -> Result<Value, ParseError> {
        if depth > MAX_DEPTH {
            return Err(self.error("nested too deeply"));
        }
        self.space();
        match self.text.get(self.at) {
            None => Err(self.error("unexpected end")),
            Some(b'{') => {
                self.at += 1;
                let mut fields = Vec::new();
                if self.eat(b'}') {
                    return Ok(Value::Object(fields));
                }
                loop {
                    self.space();
                    let key = self.string()?;
                    if !self.eat(b':') {
                        return Err(self.error("expected `:`"));
                    }
                    fields.push((key, self.value(depth + 1)?));
                    if self.eat(b'}') {
                        return Ok(Value::Object(fields));
                    }
                    if !self.eat(b',') {
                        return Err(self.error("expected `,` or `}`"));
                    }
                }
            }
            Some(b'[') => {
                self.at += 1;
                let mut items = Vec::new();
                if self.eat(b']') {
                    return Ok(Value::Array(items));
                }
                loop {
                    items.push(self.value(depth + 1)?);
                    if self.eat(b']') {
                        return Ok(Value::Array(items));
                    }
                    if !self.eat(b',') {
                        return Err(self.error("expected `,` or `]`"));
                    }
                }
            }
            Some(b'"') => Ok(Value::String(self.string()?)),
            Some(b't') => self.literal("true", Value::Bool(true)),
            Some(b'f') => self.literal("false", Value::Bool(false)),
            Some(b'n') => self.literal("null", Value::Null),
            Some(_) => self.number(),
        }
    }

    fn number(&mut self) -> Result<Value, ParseError> {
        let start = self.at;
        while self.text.get(self.at).is_some_and(|c| c.is_ascii_digit() || b"+-.eE".contains(c)) {
            self.at += 1;
        }
        // Rust's float syntax is a superset of JSON's on these characters, except a leading `+`.
        let token = std::str::from_utf8(&self.text[start..self.at]).unwrap_or_default();
        match token.parse::<f64>() {
            Ok(x) if !token.starts_with('+') && x.is_finite() => Ok(Value::Number(x)),
            _ => Err(ParseError { at: start, message: format!("bad number `{token}`") }),
        }
    }

    fn string(&mut self) -> Result<String, ParseError> {
        if self.text.get(self.at) != Some(&b'"') {
            return Err(self.error("expected a string"));
        }
        self.at += 1;
        let mut out = String::new();
        loop {
            let start = self.at;
            while self.text.get(self.at).is_some_and(|&c| c != b'"' && c != b'\\' && c >= 0x20) {
                self.at += 1;
            }
            // The input is a &str and the run stops only at ASCII bytes: whole characters.
            out.push_str(std::str::from_utf8(&self.text[start..self.at]).unwrap_or_default());
            match self.text.get(self.at) {
                Some(b'"') => {
                    self.at += 1;
                    return Ok(out);
                }
                Some(b'\\') => {
                    let c = self.text.get(self.at + 1).copied();
                    self.at += 2;
                    out.push(match c {
                        Some(b'"') => '"',
                        Some(b'\\') => '\\',
                        Some(b'/') => '/',
                        Some(b'b') => '\u{8}',
                        Some(b'f') => '\u{c}',
                        Some(b'n') => '\n',
                        Some(b'r') => '\r',
                        Some(b't') => '\t',
                        Some(b'u') => self.unicode_escape()?,
                        _ => return Err(self.error("bad escape")),
                    });
                }
                _ => return Err(self.error("unterminated string")),
            }
        }
    }

    /// The character of a `\uXXXX` escape (the `\u` consumed), joining a surrogate pair.
    fn unicode_escape(&mut self) -> Result<char, ParseError> {
        let hex = |p: &mut Self| -> Result<u32, ParseError> {
            let digits = p
                .text
                .get(p.at..p.at + 4)
                .and_then(|d| std::str::from_utf8(d).ok())
                .and_then(|d| u32::from_str_radix(d, 16).ok());
            p.at += 4;
            digits.ok_or_else(|| p.error("bad \\u escape"))
        };
        let high = hex(self)?;
        let code = if (0xD800..0xDC00).contains(&high) && self.text[self.at..].starts_with(b"\\u") {
            self.at += 2;
            let low = hex(self)?;
            0x10000 + ((high - 0xD800) << 10) + (low.wrapping_sub(0xDC00) & 0x3FF)
        } else {
            high
        };
        char::from_u32(code).ok_or_else(|| self.error("\\u escape is not a character"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_are_escaped() {
        assert_eq!(string("a\"b\\c\nd\u{1}é"), r#""a\"b\\c\nd\u0001é""#);
    }

    #[test]
    fn numbers_round_trip_and_non_finite_is_null() {
        assert_eq!(number(3.0), "3");
        assert_eq!(number(-0.25), "-0.25");
        assert_eq!(number(1.5e-7), "1.5e-7");
        assert_eq!(number(134217728.5), "1.342177285e8");
        assert_eq!(number(f64::NAN), "null");
        assert_eq!(number(f64::INFINITY), "null");
        for x in [1.2345678901234567e-9, 0.1, 123456.789, 7.0e300] {
            assert_eq!(number(x).parse::<f64>().unwrap(), x);
        }
    }

    #[test]
    fn objects_and_arrays_nest() {
        let inner = Object::new().int("n", 2).bool("ok", true).finish();
        let o = Object::new()
            .str("name", "x")
            .num("e", 0.5)
            .raw("inner", &inner)
            .raw("list", &array(["1".into(), "2".into()]));
        assert_eq!(o.finish(), r#"{"name":"x","e":0.5,"inner":{"n":2,"ok":true},"list":[1,2]}"#);
    }

    #[test]
    fn written_json_reads_back() {
        let inner =
            Object::new().num("small", 1.5e-7).num("neg", -0.25).raw("none", "null").finish();
        let text = Object::new()
            .str("name", "a \"q\" \\ é\n\u{1}")
            .bool("ok", false)
            .raw("inner", &inner)
            .raw("list", &array(["1".into(), "[]".into(), "{}".into()]))
            .finish();
        let v = parse(&format!("  {text}\n")).unwrap();
        assert_eq!(v.get("name").and_then(Value::as_str), Some("a \"q\" \\ é\n\u{1}"));
        assert_eq!(v.get("ok"), Some(&Value::Bool(false)));
        let inner = v.get("inner").unwrap();
        assert_eq!(inner.get("small").and_then(Value::as_f64), Some(1.5e-7));
        assert_eq!(inner.get("none"), Some(&Value::Null));
        assert_eq!(v.get("list").and_then(Value::as_array).map(|a| a.len()), Some(3));
        for x in [0.1f32, -3.4028235e38, 1.0e-45, 7.5] {
            assert_eq!(parse(&number(x as f64)).unwrap().as_f64().map(|y| y as f32), Some(x));
        }
        assert_eq!(parse(r#""\u00e9\ud83d\ude00\/""#).unwrap(), Value::String("é😀/".into()));
    }

    #[test]
    fn bad_json_says_where() {
        for (text, at) in [
            ("{\"a\":}", 5),
            ("[1,]", 3),
            ("{\"a\" 1}", 5),
            ("\"open", 5),
            ("+1", 0),
            ("1 2", 2),
            ("[1e999]", 1),
            ("tru", 0),
        ] {
            let e = parse(text).unwrap_err();
            assert_eq!(e.at, at, "{text}: {e}");
        }
        assert!(parse(&"[".repeat(100)).unwrap_err().message.contains("deeply"));
    }
}
