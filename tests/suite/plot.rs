//! `syncstep plot` as a user runs it: the built binary on a metrics log written by
//! `metrics::MetricsLog`, to SVG and PNG, and the outputs it must refuse.

use std::path::Path;
use std::process::{Command, Output};

use syncstep::metrics::{MetricsLog, Record};

/// A fresh folder of this test's own, removed when dropped, however the test ends.
fn dir(test: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("syncstep-plot-{test}-")).tempdir().unwrap()
}

/// A log of 50 training steps with evaluations after steps 10, 30 and 50.
fn write_log(path: &Path) {
    let mut log = MetricsLog::open(path, None, &[], false).unwrap();
    for step in 1..=50u64 {
        let noise = if step % 2 == 0 { 0.2 } else { -0.2 };
        log.write(&Record {
            step,
            epoch: (step - 1) / 10,
            loss: Some(2.3 / (1.0 + step as f32 / 10.0) + noise),
            lr: Some(0.1 * (1.0 - step as f32 / 50.0)),
            images_per_s: Some(300.0),
            data_wait: Some(0.05),
            ..Record::default()
        })
        .unwrap();
        if step % 20 == 10 {
            let top1 = step as f64 / 60.0;
            log.write(&Record {
                step,
                epoch: (step - 1) / 10,
                val_top1: Some(top1),
                val_top5: Some((top1 + 0.3).min(1.0)),
                ..Record::default()
            })
            .unwrap();
        }
    }
}

fn plot(args: &[&Path]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_syncstep"));
    command.arg("plot");
    for arg in args {
        command.arg(arg);
    }
    command.output().unwrap()
}

/// The contents of the SVG's text elements, trimmed.
fn texts(svg: &str) -> Vec<&str> {
    svg.split("<text")
        .skip(1)
        .filter_map(|element| {
            let (_, rest) = element.split_once('>')?;
            let (content, _) = rest.split_once("</text>")?;
            Some(content.trim())
        })
        .collect()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn an_svg_has_the_curves_and_their_axis_labels() {
    let tmp = dir("svg");
    let d = tmp.path();
    let log = d.join("metrics.jsonl");
    write_log(&log);
    let out = d.join("curves.SVG");
    let output = plot(&[&log, Path::new("-o"), &out]);
    assert!(output.status.success(), "{}", stderr(&output));
    let svg = std::fs::read_to_string(&out).unwrap();
    assert!(svg.trim_start().starts_with("<svg") || svg.contains("<svg "), "{svg}");
    assert!(svg.trim_end().ends_with("</svg>"));
    let texts = texts(&svg);
    for text in ["metrics.jsonl: 50 steps", "step", "loss", "learning rate", "accuracy (%)"] {
        assert!(texts.contains(&text), "no text {text:?} in the SVG: {texts:?}");
    }
    assert!(texts.contains(&"top-1") && texts.contains(&"top-5"), "{texts:?}");
    assert!(svg.contains("<polyline") || svg.contains("<path"), "no lines drawn");
}

fn a_png_has_the_size_asked_for_and_a_drawing() {
    let tmp = dir("png");
    let d = tmp.path();
    let log = d.join("metrics.jsonl");
    write_log(&log);
    let out = d.join("curves.png");
    let output = Command::new(env!("CARGO_BIN_EXE_syncstep"))
        .args(["plot", "--width", "640", "--height", "480", "-o"])
        .arg(&out)
        .arg(&log)
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    let image = image::open(&out).unwrap().to_rgb8();
    assert_eq!(image.dimensions(), (640, 480));
    let first = image.get_pixel(0, 0);
    let others = image.pixels().filter(|p| *p != first).count();
    assert!(others > 640 * 480 / 100, "only {others} pixels differ from the background");
    // Text is drawn: dark pixels in the title's band at the top.
    let dark_in_title = (0..640)
        .flat_map(|x| (0..30).map(move |y| (x, y)))
        .filter(|&(x, y)| image.get_pixel(x, y).0.iter().all(|&c| c < 100))
        .count();
    assert!(dark_in_title > 50, "no title text ({dark_in_title} dark pixels)");
}

fn the_input_is_never_the_output() {
    let tmp = dir("same");
    let d = tmp.path();
    let log = d.join("metrics.jsonl");
    write_log(&log);
    let before = std::fs::read(&log).unwrap();
    let link = d.join("metrics.svg");
    std::os::unix::fs::symlink(&log, &link).unwrap();
    let output = plot(&[&log, Path::new("-o"), &link]);
    assert!(!output.status.success());
    assert!(stderr(&output).contains("same file as the input"), "{}", stderr(&output));
    assert_eq!(std::fs::read(&log).unwrap(), before);
}

fn an_unknown_extension_is_refused() {
    let tmp = dir("extension");
    let d = tmp.path();
    let log = d.join("metrics.jsonl");
    write_log(&log);
    for name in ["curves.pdf", "curves"] {
        let out = d.join(name);
        let output = plot(&[&log, Path::new("-o"), &out]);
        assert!(!output.status.success());
        assert!(stderr(&output).contains(".svg and .png are supported"), "{}", stderr(&output));
        assert!(!out.exists());
    }
}

fn a_log_without_training_records_is_refused() {
    let tmp = dir("no-loss");
    let d = tmp.path();
    let log = d.join("metrics.jsonl");
    let mut writer = MetricsLog::open(&log, None, &[], false).unwrap();
    writer.write(&Record { step: 0, val_top1: Some(0.1), ..Record::default() }).unwrap();
    drop(writer);
    let out = d.join("curves.svg");
    let output = plot(&[&log, Path::new("-o"), &out]);
    assert!(!output.status.success());
    assert!(stderr(&output).contains("no training records in"), "{}", stderr(&output));
    assert!(!out.exists());
}

fn an_output_that_is_not_a_regular_file_is_left_alone() {
    let tmp = dir("folder");
    let d = tmp.path();
    let log = d.join("metrics.jsonl");
    write_log(&log);
    let out = d.join("curves.png");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("keep"), b"mine").unwrap();
    let output = plot(&[&log, Path::new("-o"), &out]);
    assert!(!output.status.success());
    assert!(stderr(&output).contains("not a regular file"), "{}", stderr(&output));
    assert_eq!(std::fs::read(out.join("keep")).unwrap(), b"mine");
}

fn a_size_out_of_bounds_is_refused() {
    let tmp = dir("size");
    let d = tmp.path();
    let log = d.join("metrics.jsonl");
    write_log(&log);
    let out = d.join("curves.png");
    for (flag, value) in [("--width", "99"), ("--height", "10001")] {
        let output = Command::new(env!("CARGO_BIN_EXE_syncstep"))
            .args(["plot", flag, value, "-o"])
            .arg(&out)
            .arg(&log)
            .output()
            .unwrap();
        assert!(!output.status.success());
        assert!(stderr(&output).contains("100..=10000"), "{}", stderr(&output));
        assert!(!out.exists());
    }
}

tests![
    an_svg_has_the_curves_and_their_axis_labels,
    a_png_has_the_size_asked_for_and_a_drawing,
    the_input_is_never_the_output,
    an_unknown_extension_is_refused,
    a_log_without_training_records_is_refused,
    an_output_that_is_not_a_regular_file_is_left_alone,
    a_size_out_of_bounds_is_refused,
];
