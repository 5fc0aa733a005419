//! `syncstep plot`: a training run's curves from its metrics log (`train --log`), as SVG or
//! PNG: the loss with its running median (what `train` prints beside each step's), the learning
//! rate, and the validation accuracy when the run was evaluated. Text is laid out and, in PNG,
//! drawn with a font built into the binary, so that no system font library is needed.

use std::error::Error;
use std::ops::Range;
use std::path::{Path, PathBuf};

use clap::Args;
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use syncstep::files;
use syncstep::metrics::{self, Record};
use syncstep::train::{smoothed_losses, LOSS_WINDOW};

/// DejaVu Sans (assets/fonts/LICENSE), registered as plotters' "sans-serif".
const FONT: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");
/// The loss's running median spans 1/SMOOTHING of the run's training steps, and at least the
/// steps `train`'s own spans.
const SMOOTHING: usize = 50;
/// Green dark enough to read on white.
const DARK_GREEN: RGBColor = RGBColor(0, 140, 0);

/// What marks a picture as plot's own, with the SHA-256 of the rest of it ([`seal`]): an SVG's
/// first line is a comment of it; a PNG's last chunk before its end is a `Software` text chunk
/// of it. A picture that only copies the words is not one.
const MARK: &str = "syncstep plot";

/// A picture plot drew (`-o`), told by its mark and the hash in it.
const PICTURE: files::Kind = files::Kind { what: "a picture syncstep plot drew", ours: is_plot };

fn is_plot(path: &Path) -> bool {
    // Plot's pictures are a few megabytes at most; a large file is not one, and is not read.
    if !std::fs::metadata(path).is_ok_and(|m| m.len() < 256 << 20) {
        return false;
    }
    let Ok(bytes) = files::read_input(path) else { return false };
    svg_unsealed(&bytes)
        .or_else(|| png_unsealed(&bytes))
        .is_some_and(|(hash, rest)| hash == seal(&rest))
}

/// The mark's text for a picture whose other bytes are `rest`.
fn seal(rest: &[u8]) -> String {
    use sha2::Digest;
    let hash: String = sha2::Sha256::digest(rest).iter().map(|b| format!("{b:02x}")).collect();
    format!("{MARK} sha256={hash}")
}

/// An SVG's mark (its first line's comment) and the bytes after that line.
fn svg_unsealed(bytes: &[u8]) -> Option<(String, Vec<u8>)> {
    let end = bytes.iter().position(|&b| b == b'\n')?;
    let line = std::str::from_utf8(&bytes[..end]).ok()?;
    let mark = line.strip_prefix("<!-- ")?.strip_suffix(" -->")?;
    Some((mark.to_string(), bytes[end + 1..].to_vec()))
}

/// A PNG's mark (the text of its `Software` chunk just before `IEND`) and its bytes without
/// that chunk.
fn png_unsealed(bytes: &[u8]) -> Option<(String, Vec<u8>)> {
    // IEND is 12 bytes: length, type, CRC. The mark's chunk is 12 bytes more than its text.
    let text_len = "Software\0".len() + seal(&[]).len();
    let start = bytes.len().checked_sub(12 + 12 + text_len)?;
    let (head, tail) = bytes.split_at(start);
    let (chunk, end) = tail.split_at(12 + text_len);
    let text = chunk.get(4..8).filter(|t| t == b"tEXt").and(chunk.get(8..8 + text_len))?;
    let mark = std::str::from_utf8(text.strip_prefix(b"Software\0")?).ok()?;
    Some((mark.to_string(), [head, end].concat()))
}

#[derive(Args)]
pub struct PlotArgs {
    /// The metrics log of a training run (`train --log`), JSON Lines.
    log: PathBuf,
    /// The picture to write: its extension, .svg or .png, chooses the format.
    #[arg(short = 'o', long = "out")]
    out: PathBuf,
    /// Width of the picture in pixels.
    #[arg(long, default_value_t = 1200, value_parser = clap::value_parser!(u32).range(100..=10_000), allow_negative_numbers = true)]
    width: u32,
    /// Height of the picture in pixels.
    #[arg(long, default_value_t = 800, value_parser = clap::value_parser!(u32).range(100..=10_000), allow_negative_numbers = true)]
    height: u32,
    #[command(flatten)]
    overwrite: super::Overwrite,
}

enum Format {
    Svg,
    Png,
}

impl Format {
    fn of(path: &Path) -> Result<Format, String> {
        let extension = path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
        match extension.as_deref() {
            Some("svg") => Ok(Format::Svg),
            Some("png") => Ok(Format::Png),
            _ => Err(format!(
                "-o {}: the format is taken from the extension, and .svg and .png are supported",
                path.display()
            )),
        }
    }
}

/// What is drawn, in the units shown: (step, value) points, accuracies in %.
struct Curves {
    loss: Vec<(f64, f64)>,
    lr: Vec<(f64, f64)>,
    top1: Vec<(f64, f64)>,
    top5: Vec<(f64, f64)>,
}

impl Curves {
    fn of(records: &[Record]) -> Curves {
        let points = |value: &dyn Fn(&Record) -> Option<f64>| -> Vec<(f64, f64)> {
            records.iter().filter_map(|r| Some((r.step as f64, value(r)?))).collect()
        };
        Curves {
            loss: points(&|r| r.loss.map(f64::from)),
            lr: points(&|r| r.lr.map(f64::from)),
            top1: points(&|r| r.val_top1.map(|a| 100.0 * a)),
            top5: points(&|r| r.val_top5.map(|a| 100.0 * a)),
        }
    }

    /// The steps every panel shows, so that they line up.
    fn steps(&self) -> Range<f64> {
        let all = [&self.loss, &self.lr, &self.top1, &self.top5];
        let steps = all.iter().flat_map(|c| c.iter().map(|&(step, _)| step));
        let (first, last) = steps.fold((f64::MAX, f64::MIN), |(lo, hi), s| (lo.min(s), hi.max(s)));
        first..last.max(first + 1.0)
    }
}

pub fn run(args: PlotArgs) -> Result<(), Box<dyn Error>> {
    if args.log.is_dir() {
        return Err(format!(
            "{} is a folder: give the metrics log of a training run (its train --log file)",
            args.log.display()
        )
        .into());
    }
    // What the path is comes before what its extension says (a folder named x.svg).
    let _claim =
        files::check_output("-o", &args.out, &[&args.log], PICTURE, args.overwrite.overwrite)?;
    let format = Format::of(&args.out)?;
    let records = metrics::read(&args.log)?;
    let curves = Curves::of(&records);
    let (Some(first), Some(last)) = (curves.loss.first(), curves.loss.last()) else {
        return Err(format!(
            "no training records in {} (no line has a loss): give the --log file of a training run",
            args.log.display()
        )
        .into());
    };
    let name = args.log.file_name().unwrap_or(args.log.as_os_str()).to_string_lossy();
    let steps = curves.loss.len();
    let title = if first.0 == 1.0 && last.0 == steps as f64 {
        format!("{name}: {steps} steps")
    } else {
        format!("{name}: {steps} steps ({}–{})", first.0, last.0)
    };
    plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
        .map_err(|_| "the built-in font DejaVuSans.ttf is not a font this build can read")?;
    let size = (args.width, args.height);
    let bytes = match format {
        Format::Svg => {
            let mut svg = String::new();
            {
                let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
                draw(&root, &curves, &title)?;
                root.present()?;
            }
            format!("<!-- {} -->\n{svg}", seal(svg.as_bytes())).into_bytes()
        }
        Format::Png => png(&curves, &title, size)?,
    };
    files::write_atomic(&args.out, &bytes)?;
    let evaluations = match curves.top1.len().max(curves.top5.len()) {
        0 => String::new(),
        n => format!(", accuracy at {n} evaluations"),
    };
    say!(
        "{}: loss over {steps} steps{evaluations} ({}×{})",
        args.out.display(),
        args.width,
        args.height
    );
    Ok(())
}

/// The curves drawn into an RGB buffer, encoded as PNG.
fn png(
    curves: &Curves,
    title: &str,
    (width, height): (u32, u32),
) -> Result<Vec<u8>, Box<dyn Error>> {
    let mut rgb = vec![0u8; width as usize * height as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, (width, height)).into_drawing_area();
        draw(&root, curves, title)?;
        root.present()?;
    }
    // Encoded twice (the same bytes each time): the mark holds the hash of the first.
    let unsealed = encode_png(&rgb, (width, height), None)?;
    encode_png(&rgb, (width, height), Some(&seal(&unsealed)))
}

/// `rgb` as a PNG, with `mark` as a `Software` text chunk just before its end.
fn encode_png(
    rgb: &[u8],
    (width, height): (u32, u32),
    mark: Option<&str>,
) -> Result<Vec<u8>, Box<dyn Error>> {
    let mut png = Vec::new();
    let mut encoder = png::Encoder::new(&mut png, width, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header()?;
    writer.write_image_data(rgb)?;
    if let Some(mark) = mark {
        writer.write_text_chunk(&png::text_metadata::TEXtChunk::new("Software", mark))?;
    }
    writer.finish()?;
    Ok(png)
}

/// Draws the title and the panels: the loss, the accuracy when the run was evaluated, and the
/// learning rate when the log has it, stacked over the same steps.
fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    curves: &Curves,
    title: &str,
) -> Result<(), Box<dyn Error>>
where
    DB::ErrorType: 'static,
{
    // Sizes are chosen for the default 1200×800, and follow the picture's area.
    let (width, height) = root.dim_in_pixel();
    let factor = (f64::from(width) * f64::from(height) / (1200.0 * 800.0)).sqrt();
    let scale = |size: f64| (size * factor).max(6.0);
    root.fill(&WHITE)?;
    let body = root.titled(title, ("sans-serif", scale(26.0)))?;
    let accuracy = !curves.top1.is_empty() || !curves.top5.is_empty();
    let lr = !curves.lr.is_empty();
    let body_height = f64::from(body.dim_in_pixel().1);
    let accuracy_height = if accuracy { 0.27 * body_height } else { 0.0 };
    let lr_height = if lr { 0.2 * body_height } else { 0.0 };
    let (loss_area, rest) =
        body.split_vertically((body_height - accuracy_height - lr_height) as i32);
    let (accuracy_area, lr_area) = rest.split_vertically(accuracy_height as i32);
    let steps = curves.steps();

    let window = (curves.loss.len() / SMOOTHING).max(LOSS_WINDOW);
    let range = value_range(&curves.loss, None);
    let mut loss = panel(&loss_area, &steps, range, "loss", &scale)?;
    let raw = BLUE.mix(0.3);
    loss.draw_series(LineSeries::new(curves.loss.iter().copied(), raw))?
        .label("loss")
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], raw));
    let values: Vec<f32> = curves.loss.iter().map(|&(_, v)| v as f32).collect();
    let smoothed = curves.loss.iter().zip(smoothed_losses(&values, window));
    let smoothed = smoothed.map(|(&(step, _), median)| (step, f64::from(median)));
    loss.draw_series(LineSeries::new(smoothed, BLUE.stroke_width(2)))?
        .label(format!("median of the last {window} steps"))
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLUE.stroke_width(2)));
    legend(&mut loss, SeriesLabelPosition::UpperRight, &scale)?;

    if accuracy {
        let mut chart = panel(&accuracy_area, &steps, 0.0..100.0, "accuracy (%)", &scale)?;
        let series = [(&curves.top1, RED, "top-1"), (&curves.top5, DARK_GREEN, "top-5")];
        for (points, color, label) in series.into_iter().filter(|(p, ..)| !p.is_empty()) {
            let line = LineSeries::new(points.iter().copied(), color.stroke_width(2)).point_size(3);
            chart.draw_series(line)?.label(label).legend(move |(x, y)| {
                PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2))
            });
        }
        legend(&mut chart, SeriesLabelPosition::LowerRight, &scale)?;
    }
    if lr {
        let range = value_range(&curves.lr, Some(0.0));
        let mut chart = panel(&lr_area, &steps, range, "learning rate", &scale)?;
        chart.draw_series(LineSeries::new(curves.lr.iter().copied(), BLACK.stroke_width(2)))?;
    }
    Ok(())
}

type Chart<'a, DB> = ChartContext<'a, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// A panel's chart over `steps` and `values`, its axes drawn and labelled.
fn panel<'a, DB: DrawingBackend>(
    area: &'a DrawingArea<DB, Shift>,
    steps: &Range<f64>,
    values: Range<f64>,
    name: &str,
    scale: &dyn Fn(f64) -> f64,
) -> Result<Chart<'a, DB>, Box<dyn Error>>
where
    DB::ErrorType: 'static,
{
    // A tick label every 40 pixels or so of the panel's height, and at least two.
    let (_, height) = area.dim_in_pixel();
    let y_labels = (f64::from(height) / scale(40.0)).max(2.0) as usize;
    let decimals = decimals((values.end - values.start) / y_labels as f64);
    let mut chart = ChartBuilder::on(area)
        .margin(scale(10.0))
        .margin_right(scale(30.0))
        .x_label_area_size(scale(40.0))
        .y_label_area_size(scale(80.0))
        .build_cartesian_2d(steps.clone(), values)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc(name)
        .label_style(("sans-serif", scale(14.0)))
        .axis_desc_style(("sans-serif", scale(16.0)))
        .x_label_formatter(&|step| format!("{step:.0}"))
        .y_label_formatter(&|value| format!("{value:.decimals$}"))
        .y_labels(y_labels)
        .max_light_lines(0)
        .draw()?;
    Ok(chart)
}

/// The chart's series names, in a box at `position`.
fn legend<'a, DB: DrawingBackend + 'a>(
    chart: &mut Chart<'a, DB>,
    position: SeriesLabelPosition,
    scale: &dyn Fn(f64) -> f64,
) -> Result<(), Box<dyn Error>>
where
    DB::ErrorType: 'static,
{
    chart
        .configure_series_labels()
        .label_font(("sans-serif", scale(14.0)))
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(position)
        .draw()?;
    Ok(())
}

/// The range of the points' values, from `floor` when it is lower, with a margin: never empty.
fn value_range(points: &[(f64, f64)], floor: Option<f64>) -> Range<f64> {
    let values = points.iter().map(|&(_, v)| v);
    let (lo, hi) = values.fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let lo = floor.map_or(lo, |f| lo.min(f));
    let margin = if hi > lo { 0.05 * (hi - lo) } else { 0.1 * hi.abs().max(1e-3) };
    let lo = if floor == Some(lo) { lo } else { lo - margin };
    lo..hi + margin
}

/// Decimals the tick labels of an axis need when its ticks are at least `spacing` apart (they
/// fall on round numbers: 0.05 apart for a spacing of 0.04 needs two, 5e-5 apart five).
fn decimals(spacing: f64) -> usize {
    (-spacing.log10().floor()).clamp(0.0, 9.0) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tick_labels_have_the_decimals_the_axis_needs() {
        assert_eq!(decimals(0.4), 1);
        assert_eq!(decimals(0.04), 2);
        assert_eq!(decimals(20.0), 0);
        assert_eq!(decimals(2e-5), 5);
    }
}
