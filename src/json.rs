//! A minimal JSON writer for the reports the faces print and the browser receives (the kernel
//! self-check, adapter info, later the equivalence gates). Hand-written so the wasm build needs
//! no serde; the same text is what the native CLI can print and the page parses.
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
        let o = Object::new().str("name", "x").num("e", 0.5).raw("inner", &inner).raw("list", &array(["1".into(), "2".into()]));
        assert_eq!(o.finish(), r#"{"name":"x","e":0.5,"inner":{"n":2,"ok":true},"list":[1,2]}"#);
    }
}
