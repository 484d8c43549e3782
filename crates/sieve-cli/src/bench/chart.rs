//! Charts of a benchmark run, as SVG and PNG: per-query speed-up over the
//! `off` mode and bytes moved per mode, grouped bars like the source
//! documents' figures. Text is drawn with DejaVu Sans, bundled (assets/fonts).

use std::path::{Path, PathBuf};
use std::sync::Once;

use datafusion::common::{exec_datafusion_err, Result};
use plotters::coord::Shift;
use plotters::prelude::*;

use super::report::BenchReport;

static FONT: &[u8] = include_bytes!("../../../../assets/fonts/DejaVuSans.ttf");

fn register_font() {
    static REGISTER: Once = Once::new();
    REGISTER.call_once(|| {
        // The bundled font is valid TrueType; a failure would only lose text.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    });
}

const COLORS: [RGBColor; 4] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
];

struct Bars<'a> {
    title: String,
    y_label: &'a str,
    categories: Vec<String>,
    /// (series name, one value per category).
    series: Vec<(String, Vec<f64>)>,
    /// Values are log10 of the quantity; the axis shows the quantity.
    log10: bool,
}

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, bars: &Bars<'_>) -> Result<()> {
    let error = |error: &dyn std::fmt::Debug| exec_datafusion_err!("chart: {error:?}");
    root.fill(&WHITE).map_err(|e| error(&e))?;
    let width = bars.series.len() as i32 + 1;
    let count = bars.categories.len() as i32;
    let values = bars
        .series
        .iter()
        .flat_map(|(_, values)| values.iter().copied());
    let (low, high) = values.fold((0.0f64, 0.0f64), |(low, high), value| {
        (low.min(value), high.max(value))
    });
    let (low, high) = if bars.log10 {
        (low.floor(), high.ceil().max(low.floor() + 1.0))
    } else {
        (0.0, (high * 1.1).max(1.0))
    };
    let mut chart = ChartBuilder::on(&root)
        .caption(&bars.title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(70)
        .build_cartesian_2d(0..count * width, low..high)
        .map_err(|e| error(&e))?;
    let categories = &bars.categories;
    let middle = (bars.series.len() as i32 - 1) / 2;
    let log10 = bars.log10;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels((count * width) as usize + 1)
        .x_label_formatter(&|x| {
            if x % width == middle {
                categories
                    .get((x / width) as usize)
                    .cloned()
                    .unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc(bars.y_label)
        .y_label_formatter(&|y| {
            if log10 {
                let value = 10f64.powf(*y);
                if value >= 10.0 {
                    format!("{value:.0}")
                } else {
                    let text = format!("{value:.4}");
                    text.trim_end_matches('0').trim_end_matches('.').to_string()
                }
            } else {
                format!("{y:.1}")
            }
        })
        .label_style(("sans-serif", 13))
        .draw()
        .map_err(|e| error(&e))?;
    for (index, (name, values)) in bars.series.iter().enumerate() {
        // One colour per mode in every chart, whichever modes it shows.
        let color = match name.as_str() {
            "ndp" => COLORS[0],
            "off" => COLORS[1],
            "duckdb" => COLORS[2],
            _ => COLORS[3],
        };
        chart
            .draw_series(values.iter().enumerate().map(|(category, value)| {
                let x = category as i32 * width + index as i32;
                Rectangle::new([(x, low), (x + 1, *value)], color.filled())
            }))
            .map_err(|e| error(&e))?
            .label(name.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 12, y + 6)], color.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(|e| error(&e))?;
    root.present().map_err(|e| error(&e))?;
    Ok(())
}

fn benchmark_name(benchmark: &str) -> String {
    match benchmark {
        "tpch" => "TPC-H".to_string(),
        other => other.to_uppercase(),
    }
}

fn both(directory: &Path, stem: &str, bars: &Bars<'_>) -> Result<Vec<PathBuf>> {
    let size = (160 + 60 * bars.categories.len() as u32, 560);
    let svg = directory.join(format!("{stem}.svg"));
    let png = directory.join(format!("{stem}.png"));
    draw(SVGBackend::new(&svg, size).into_drawing_area(), bars)?;
    draw(BitMapBackend::new(&png, size).into_drawing_area(), bars)?;
    Ok(vec![svg, png])
}

/// Write `speedup.svg/png` (each mode's time against `off`, or against the
/// first mode without it) and `bytes.svg/png` (bytes moved per mode, log
/// scale) into `directory`; returns the files written.
pub fn write_charts(report: &BenchReport, directory: &Path) -> Result<Vec<PathBuf>> {
    register_font();
    let categories: Vec<String> = report.queries.iter().map(|q| q.name.clone()).collect();
    let baseline = report
        .modes
        .iter()
        .position(|mode| mode == "off")
        .unwrap_or(0);
    let link = match (&report.link.rate, report.link.emulated) {
        (Some(rate), true) => format!("{rate} link"),
        _ => "loopback".to_string(),
    };
    let speedup = Bars {
        title: format!(
            "{} SF {}, {} nodes, {link}: speed-up over {}",
            benchmark_name(&report.benchmark),
            report.scale_factor,
            report.nodes,
            report.modes[baseline]
        ),
        y_label: "time of baseline / time of mode",
        categories: categories.clone(),
        series: report
            .modes
            .iter()
            .enumerate()
            .filter(|(mode, _)| *mode != baseline)
            .map(|(mode, name)| {
                let values = report
                    .queries
                    .iter()
                    .map(|q| {
                        q.modes[baseline].wall_ms_median / q.modes[mode].wall_ms_median.max(1e-9)
                    })
                    .collect();
                (name.clone(), values)
            })
            .collect(),
        log10: false,
    };
    let mut written = Vec::new();
    if !speedup.series.is_empty() {
        written.extend(both(directory, "speedup", &speedup)?);
    }
    let bytes = Bars {
        title: format!(
            "{} SF {}, {} nodes, {link}: bytes moved per query",
            benchmark_name(&report.benchmark),
            report.scale_factor,
            report.nodes
        ),
        y_label: "MB (log scale)",
        categories,
        series: report
            .modes
            .iter()
            .enumerate()
            .filter(|(mode, _)| {
                report
                    .queries
                    .iter()
                    .all(|q| q.modes[*mode].bytes_moved.is_some())
            })
            .map(|(mode, name)| {
                let values = report
                    .queries
                    .iter()
                    .map(|q| {
                        (q.modes[mode].bytes_moved.unwrap_or(0.0) / 1e6)
                            .max(1e-4)
                            .log10()
                    })
                    .collect();
                (name.clone(), values)
            })
            .collect(),
        log10: true,
    };
    if !bytes.series.is_empty() {
        written.extend(both(directory, "bytes", &bytes)?);
    }
    Ok(written)
}
