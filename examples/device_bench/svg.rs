//! The benchmark's plot: log-log line charts of GFLOP/s against problem size, one polyline per
//! device, as one self-contained SVG (no fonts, scripts or external references).
use std::fmt::Write;

/// One line of a chart: a label and its (size, GFLOP/s) points in increasing size.
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// One chart: a title, the x axis label and its series.
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub series: Vec<Series>,
}

const WIDTH: f64 = 760.0;
const CHART_HEIGHT: f64 = 380.0;
const MARGIN_LEFT: f64 = 80.0;
const MARGIN_RIGHT: f64 = 200.0;
const MARGIN_TOP: f64 = 40.0;
const MARGIN_BOTTOM: f64 = 50.0;
const COLORS: [&str; 8] = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];

/// Escapes text for SVG.
fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// The decades `10^k` covering `[low, high]`, widened to at least one decade.
fn decades(low: f64, high: f64) -> (i32, i32) {
    let low = low.max(1e-9).log10().floor() as i32;
    let high = high.max(1e-9).log10().ceil() as i32;
    (low, high.max(low + 1))
}

/// Renders `charts` stacked vertically.
pub fn render(charts: &[Chart]) -> String {
    let height = charts.len() as f64 * CHART_HEIGHT;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    for (index, chart) in charts.iter().enumerate() {
        render_chart(&mut svg, chart, index as f64 * CHART_HEIGHT);
    }
    svg.push_str("</svg>\n");
    svg
}

fn render_chart(svg: &mut String, chart: &Chart, top: f64) {
    let points = chart.series.iter().flat_map(|s| s.points.iter()).filter(|(x, y)| *x > 0.0 && *y > 0.0);
    let (mut x_min, mut x_max, mut y_min, mut y_max) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in points {
        (x_min, x_max, y_min, y_max) = (x_min.min(x), x_max.max(x), y_min.min(y), y_max.max(y));
    }
    if x_min > x_max {
        (x_min, x_max, y_min, y_max) = (1.0, 10.0, 1.0, 10.0);
    }
    let (x_low, x_high) = decades(x_min, x_max);
    let (y_low, y_high) = decades(y_min, y_max);
    let (left, right) = (MARGIN_LEFT, WIDTH - MARGIN_RIGHT);
    let (plot_top, bottom) = (top + MARGIN_TOP, top + CHART_HEIGHT - MARGIN_BOTTOM);
    let x_of = |x: f64| left + (x.log10() - x_low as f64) / (x_high - x_low) as f64 * (right - left);
    let y_of = |y: f64| bottom - (y.log10() - y_low as f64) / (y_high - y_low) as f64 * (bottom - plot_top);

    let _ = writeln!(
        svg,
        r#"<text x="{}" y="{}" font-size="15" font-weight="bold">{}</text>"#,
        left,
        top + 24.0,
        escape(&chart.title)
    );
    let _ = writeln!(
        svg,
        r##"<rect x="{left}" y="{plot_top}" width="{}" height="{}" fill="none" stroke="#444"/>"##,
        right - left,
        bottom - plot_top
    );
    for decade in x_low..=x_high {
        let x = x_of(10f64.powi(decade));
        let _ = writeln!(svg, r##"<line x1="{x:.1}" y1="{plot_top}" x2="{x:.1}" y2="{bottom}" stroke="#ddd"/>"##);
        let _ = writeln!(svg, r#"<text x="{x:.1}" y="{}" text-anchor="middle">1e{decade}</text>"#, bottom + 16.0);
    }
    for decade in y_low..=y_high {
        let y = y_of(10f64.powi(decade));
        let _ = writeln!(svg, r##"<line x1="{left}" y1="{y:.1}" x2="{right}" y2="{y:.1}" stroke="#ddd"/>"##);
        let _ = writeln!(svg, r#"<text x="{}" y="{:.1}" text-anchor="end">1e{decade}</text>"#, left - 6.0, y + 4.0);
    }
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        (left + right) / 2.0,
        bottom + 36.0,
        escape(&chart.x_label)
    );
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="{}" text-anchor="middle" transform="rotate(-90 {} {})">GFLOP/s</text>"#,
        left - 52.0,
        (plot_top + bottom) / 2.0,
        left - 52.0,
        (plot_top + bottom) / 2.0
    );
    for (index, series) in chart.series.iter().enumerate() {
        let color = COLORS[index % COLORS.len()];
        let path: Vec<String> = series
            .points
            .iter()
            .filter(|(x, y)| *x > 0.0 && *y > 0.0)
            .map(|&(x, y)| format!("{:.1},{:.1}", x_of(x), y_of(y)))
            .collect();
        let _ =
            writeln!(svg, r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#, path.join(" "));
        for point in &path {
            let (cx, cy) = point.split_once(',').unwrap_or(("0", "0"));
            let _ = writeln!(svg, r#"<circle cx="{cx}" cy="{cy}" r="3" fill="{color}"/>"#);
        }
        let legend_y = plot_top + 14.0 + index as f64 * 18.0;
        let _ = writeln!(
            svg,
            r#"<line x1="{}" y1="{legend_y}" x2="{}" y2="{legend_y}" stroke="{color}" stroke-width="3"/>"#,
            right + 12.0,
            right + 32.0
        );
        let _ = writeln!(svg, r#"<text x="{}" y="{}">{}</text>"#, right + 38.0, legend_y + 4.0, escape(&series.label));
    }
}
