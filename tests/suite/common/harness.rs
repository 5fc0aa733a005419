//! The test harness of the suite's binaries (libtest-mimic): every test runs on a thread of its
//! own named after it, and a test that cannot run here (no GPU adapter, no root for test hosts)
//! ends with a [`Skip`] payload, which is reported as "ignored" with its reason rather than as a
//! pass that ran nothing. Any other panic is a failure with its message. libtest-mimic does not
//! capture output: what a test prints appears as it runs, its thread's name on a panic's line.
//!
//! Each module lists its tests at its end with [`tests!`]. A test function left out of its list
//! is a function nothing calls, which the dead-code lint reports and `cargo clippy -- -D
//! warnings` (scripts/test.sh) refuses: that is what keeps a forgotten test from silently never
//! running, so no test module may allow dead code.

use std::any::Any;
use std::process::ExitCode;

use libtest_mimic::{Arguments, Completion, Failed, Trial};

/// One test: its module's path (`suite::matmul`) and function.
pub struct Test {
    pub module: &'static str,
    pub name: &'static str,
    pub run: fn(),
}

/// Lists a module's tests as `TESTS`, named `module::function` (as libtest names them, so
/// `cargo test conv2d::` filters as it always has).
macro_rules! tests {
    ($($test:ident),+ $(,)?) => {
        pub const TESTS: &[crate::common::harness::Test] = &[$(crate::common::harness::Test {
            module: module_path!(),
            name: stringify!($test),
            run: $test,
        }),+];
    };
}

/// Why a test did not run: the payload that ends it as skipped.
struct Skip(String);

/// Ends the calling test as skipped for `reason`. `resume_unwind` runs no panic hook, so nothing
/// but the harness's "ignored (reason)" line is printed.
pub fn skip(reason: String) -> ! {
    std::panic::resume_unwind(Box::new(Skip(reason)))
}

/// Runs `modules`' tests as the command line (cargo's filters, `--list`, `--test-threads` or
/// `RUST_TEST_THREADS`) says.
pub fn main(modules: &[&[Test]]) -> ExitCode {
    let (options, filters) = split_filters(std::env::args());
    let mut args = Arguments::from_iter(options);
    let threads = std::env::var("RUST_TEST_THREADS").ok().and_then(|n| n.parse().ok());
    args.test_threads = args.test_threads.or(threads);
    let mut trials: Vec<Trial> = modules.iter().flat_map(|m| m.iter()).map(Test::trial).collect();
    // One filter is libtest-mimic's, which counts what it filters out; several (which libtest
    // takes, a test running if it matches any) are applied here.
    match &filters[..] {
        [one] => args.filter = Some(one.clone()),
        [] => {}
        several => trials.retain(|t| {
            let name = t.name();
            several.iter().any(|f| if args.exact { name == f } else { name.contains(f.as_str()) })
        }),
    }
    libtest_mimic::run(&args, trials).exit_code()
}

/// The command line's options, and its filters: the words that are not an option or an
/// option's value.
fn split_filters(args: impl Iterator<Item = String>) -> (Vec<String>, Vec<String>) {
    const WITH_VALUE: [&str; 6] =
        ["--test-threads", "--logfile", "--skip", "--color", "--format", "-Z"];
    let (mut options, mut filters) = (Vec::new(), Vec::new());
    let mut value_next = true; // the program's name
    for arg in args {
        if value_next || arg.starts_with('-') {
            value_next = WITH_VALUE.contains(&arg.as_str());
            options.push(arg);
        } else {
            filters.push(arg);
        }
    }
    (options, filters)
}

impl Test {
    fn trial(&self) -> Trial {
        let module = self.module.split_once("::").map_or(self.module, |(_, module)| module);
        let name = format!("{module}::{}", self.name);
        let run = self.run;
        Trial::ignorable_test(name.clone(), move || {
            let thread = std::thread::Builder::new().name(name).spawn(run);
            match thread.expect("a thread for the test").join() {
                Ok(()) => Ok(Completion::Completed),
                Err(payload) => match payload.downcast::<Skip>() {
                    Ok(skip) => Ok(Completion::ignored_with(skip.0)),
                    Err(payload) => Err(failure(&*payload)),
                },
            }
        })
    }
}

/// A panic's message as the failure's (the panic hook has printed where it was).
fn failure(payload: &(dyn Any + Send)) -> Failed {
    let message = payload.downcast_ref::<String>().map(String::as_str);
    match message.or_else(|| payload.downcast_ref::<&str>().copied()) {
        Some(message) => format!("test panicked: {message}").into(),
        None => "test panicked".into(),
    }
}
