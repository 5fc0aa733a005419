//! The kernel self-check the browser runs (the core's selfcheck.rs), run natively: every kernel
//! passes here too, progress comes in order, and the report is the JSON the page reads.

use crate::common::*;
use syncstep::selfcheck::{self, Progress};

fn selfcheck_passes_natively_and_reports_progress_in_order() {
    let gpu = gpu();
    let mut events = Vec::new();
    let report = pollster::block_on(selfcheck::run(gpu, 1, &mut |p| {
        events.push(match p {
            Progress::Started { index, total, kernel } => format!("start {index}/{total} {kernel}"),
            Progress::Finished { index, total, check } => {
                format!("end {index}/{total} {}", check.kernel)
            }
        })
    }))
    .unwrap();
    for k in &report.kernels {
        println!("{} {}: {:.2e} (tolerance {:.0e})", k.kernel, k.shape, k.error, k.tolerance);
    }
    assert!(report.passed(), "{}", report.to_json());
    let n = report.kernels.len();
    assert!(n >= 7);
    assert_eq!(events.len(), 2 * n);
    for (i, k) in report.kernels.iter().enumerate() {
        assert_eq!(events[2 * i], format!("start {i}/{n} {}", k.kernel));
        assert_eq!(events[2 * i + 1], format!("end {i}/{n} {}", k.kernel));
    }
    let json = report.to_json();
    assert!(
        json.starts_with(r#"{"check":"kernels","adapter":"#) && json.contains(r#""pass":true"#),
        "{json}"
    );
    // The same seed gives the same data, hence bitwise the same errors on the same device.
    let again = pollster::block_on(selfcheck::run(gpu, 1, &mut |_| {})).unwrap();
    assert_eq!(again, report);
}

tests![selfcheck_passes_natively_and_reports_progress_in_order,];
