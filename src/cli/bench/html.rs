//! The human side of `conveyor bench`: one self-contained HTML page (inline CSS, inline SVG
//! charts, no script, no font or anything else fetched) drawn from the suites' [`Section`]s. Each
//! chart has its figures beside it as a table, and every axis names its unit.
use std::fmt::Write as _;

/// One suite's part of the report.
pub struct Section {
    /// Heading.
    pub title: String,
    /// Paragraphs shown under the heading (what was measured, what is missing and why).
    pub notes: Vec<String>,
    /// Charts, each drawn with its table beside it.
    pub charts: Vec<Chart>,
    /// Tables without a chart.
    pub tables: Vec<Table>,
}

/// A table: a caption, a header row and rows of cells.
pub struct Table {
    pub caption: String,
    pub header: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

/// A chart and its axes (labels carry the unit, e.g. "GFLOP/s").
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub body: ChartBody,
}

/// What a chart draws.
pub enum ChartBody {
    /// Grouped bars: one group per category, one bar per series (`None`: no figure, no bar).
    Bars { categories: Vec<String>, series: Vec<(String, Vec<Option<f64>>)> },
    /// Lines through `(x, y)` points, one per series.
    Lines { series: Vec<(String, Vec<(f64, f64)>)> },
}

/// Okabe and Ito's palette: told apart with the common colour-vision deficiencies.
const COLOURS: [&str; 7] = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#000000"];

const WIDTH: f64 = 640.0;
const HEIGHT: f64 = 400.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 105.0;

/// Escapes text for HTML and SVG.
pub fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// A figure for a table cell: 3 significant digits or so.
pub fn figure(value: f64) -> String {
    if !value.is_finite() {
        return "–".to_string();
    }
    let magnitude = value.abs();
    if magnitude >= 100.0 {
        format!("{value:.0}")
    } else if magnitude >= 10.0 {
        format!("{value:.1}")
    } else if magnitude >= 1.0 {
        format!("{value:.2}")
    } else {
        format!("{value:.3}")
    }
}

/// A tick's label: at most 3 decimals, trailing zeros dropped (`0.25`, `2`, `1000`).
fn tick_label(value: f64) -> String {
    let text = format!("{value:.3}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    if text == "-0" { "0".into() } else { text.to_string() }
}

/// Tick values from 0 (or `low`) to at least `high`: about five round steps.
fn ticks(low: f64, high: f64) -> Vec<f64> {
    let span = (high - low).max(1e-12);
    let raw = span / 5.0;
    let power = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0].iter().map(|m| m * power).find(|s| span / s <= 6.0).unwrap_or(10.0 * power);
    let start = (low / step).floor() * step;
    let mut out = Vec::new();
    let mut value = start;
    while value < high + step * 0.999 && out.len() < 20 {
        out.push(value);
        value += step;
    }
    out
}

fn svg_open(out: &mut String, chart: &Chart) {
    let _ = write!(
        out,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{t}"><rect width="{WIDTH}" height="{HEIGHT}" fill="#fff"/><text x="{cx}" y="22" text-anchor="middle" class="title">{t}</text>"##,
        t = escape(&chart.title),
        cx = WIDTH / 2.0
    );
}

fn axes(out: &mut String, chart: &Chart, y_ticks: &[f64], y_max: f64, y_min: f64) {
    let plot_h = HEIGHT - TOP - BOTTOM;
    let y_of = |v: f64| TOP + plot_h * (1.0 - (v - y_min) / (y_max - y_min).max(1e-12));
    for &tick in y_ticks {
        let y = y_of(tick);
        let _ = write!(
            out,
            r##"<line x1="{LEFT}" x2="{x2}" y1="{y:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{tx}" y="{ty:.1}" text-anchor="end" class="tick">{label}</text>"##,
            x2 = WIDTH - RIGHT,
            tx = LEFT - 6.0,
            ty = y + 4.0,
            label = tick_label(tick)
        );
    }
    let _ = write!(
        out,
        r##"<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{yb}" stroke="#333"/><line x1="{LEFT}" x2="{xr}" y1="{yb}" y2="{yb}" stroke="#333"/><text transform="translate(16,{my}) rotate(-90)" text-anchor="middle" class="axis">{yl}</text><text x="{mx}" y="{xy}" text-anchor="middle" class="axis">{xl}</text>"##,
        yb = HEIGHT - BOTTOM,
        xr = WIDTH - RIGHT,
        my = TOP + plot_h / 2.0,
        mx = LEFT + (WIDTH - LEFT - RIGHT) / 2.0,
        // Bars' category labels run diagonally below the axis; lines leave room for a legend.
        xy = HEIGHT - BOTTOM + if matches!(chart.body, ChartBody::Bars { .. }) { 72.0 } else { 46.0 },
        yl = escape(&chart.y_label),
        xl = escape(&chart.x_label)
    );
}

/// The legend under the plot: one entry per series, wrapped onto a second (and third) row when
/// the names do not fit one, the rows ending at the bottom edge.
fn legend(out: &mut String, names: &[&str]) {
    let width = |name: &str| 26.0 + 8.0 * name.chars().count() as f64;
    let mut rows: Vec<Vec<(usize, &str)>> = vec![Vec::new()];
    let mut used = 0.0;
    for (i, &name) in names.iter().enumerate() {
        let row = rows.last_mut().expect("one row at least");
        if !row.is_empty() && LEFT + used + width(name) > WIDTH - RIGHT {
            rows.push(Vec::new());
            used = 0.0;
        }
        rows.last_mut().expect("one row at least").push((i, name));
        used += width(name);
    }
    for (r, row) in rows.iter().enumerate() {
        let y = HEIGHT - 10.0 - 15.0 * (rows.len() - 1 - r) as f64;
        let mut x = LEFT;
        for &(i, name) in row {
            let _ = write!(
                out,
                r#"<rect x="{x}" y="{ry}" width="12" height="12" fill="{c}"/><text x="{tx}" y="{y}" class="tick">{n}</text>"#,
                ry = y - 10.0,
                c = COLOURS[i % COLOURS.len()],
                tx = x + 16.0,
                n = escape(name)
            );
            x += width(name);
        }
    }
}

/// A series' line: solid for the first round of colours, dashed when the colours repeat.
fn dash(series_idx: usize) -> &'static str {
    if series_idx >= COLOURS.len() { r#" stroke-dasharray="6,3""# } else { "" }
}

/// The chart as an inline SVG element.
pub fn svg(chart: &Chart) -> String {
    let mut out = String::new();
    svg_open(&mut out, chart);
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    match &chart.body {
        ChartBody::Bars { categories, series } => {
            let high = series.iter().flat_map(|(_, v)| v.iter().flatten()).fold(0.0f64, |a, &b| a.max(b));
            let y_ticks = ticks(0.0, if high > 0.0 { high } else { 1.0 });
            let y_max = *y_ticks.last().unwrap_or(&1.0);
            axes(&mut out, chart, &y_ticks, y_max, 0.0);
            let group_w = plot_w / categories.len().max(1) as f64;
            let bar_w = (group_w * 0.8) / series.len().max(1) as f64;
            for (c, category) in categories.iter().enumerate() {
                let gx = LEFT + group_w * c as f64 + group_w * 0.1;
                for (s, (name, values)) in series.iter().enumerate() {
                    let Some(value) = values.get(c).copied().flatten() else { continue };
                    let h = plot_h * (value / y_max).clamp(0.0, 1.0);
                    let _ = write!(
                        out,
                        r#"<rect x="{x:.1}" y="{y:.1}" width="{w:.1}" height="{h:.1}" fill="{col}"><title>{n}, {cat}: {v}</title></rect>"#,
                        x = gx + bar_w * s as f64,
                        y = TOP + plot_h - h,
                        w = (bar_w - 1.0).max(1.0),
                        col = COLOURS[s % COLOURS.len()],
                        n = escape(name),
                        cat = escape(category),
                        v = figure(value)
                    );
                }
                let lx = gx + group_w * 0.4;
                let ly = HEIGHT - BOTTOM + 14.0;
                let _ = write!(
                    out,
                    r#"<text transform="translate({lx:.1},{ly}) rotate(-25)" text-anchor="end" class="tick">{}</text>"#,
                    escape(category)
                );
            }
            let names: Vec<&str> = series.iter().map(|(n, _)| n.as_str()).collect();
            legend(&mut out, &names);
        }
        ChartBody::Lines { series } => {
            let points = || series.iter().flat_map(|(_, p)| p.iter());
            let (x_high, y_high) = points().fold((0.0f64, 0.0f64), |(a, b), &(x, y)| (a.max(x), b.max(y)));
            let x_ticks = ticks(0.0, if x_high > 0.0 { x_high } else { 1.0 });
            // The y axis starts at 0 unless every value sits in the top half of the range (an
            // accuracy between 0.8 and 1): then it starts just below the lowest, as a zoom.
            let y_low = points().map(|p| p.1).fold(f64::INFINITY, f64::min);
            let y_from = if y_low.is_finite() && y_low > 0.5 * y_high { y_low } else { 0.0 };
            let y_ticks = ticks(y_from, if y_high > y_from { y_high } else { y_from + 1.0 });
            let (x_max, y_max) = (*x_ticks.last().unwrap_or(&1.0), *y_ticks.last().unwrap_or(&1.0));
            let y_min = *y_ticks.first().unwrap_or(&0.0);
            axes(&mut out, chart, &y_ticks, y_max, y_min);
            for &tick in &x_ticks {
                let x = LEFT + plot_w * tick / x_max;
                let _ = write!(
                    out,
                    r#"<text x="{x:.1}" y="{y}" text-anchor="middle" class="tick">{}</text>"#,
                    tick_label(tick),
                    y = HEIGHT - BOTTOM + 18.0
                );
            }
            for (s, (name, values)) in series.iter().enumerate() {
                let colour = COLOURS[s % COLOURS.len()];
                let coords: Vec<String> = values
                    .iter()
                    .map(|&(x, y)| {
                        let y_frac = (y - y_min) / (y_max - y_min).max(1e-12);
                        format!("{:.1},{:.1}", LEFT + plot_w * x / x_max, TOP + plot_h * (1.0 - y_frac))
                    })
                    .collect();
                let _ = write!(
                    out,
                    r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="2"{}><title>{}</title></polyline>"#,
                    coords.join(" "),
                    dash(s),
                    escape(name)
                );
                for point in &coords {
                    let (cx, cy) = point.split_once(',').unwrap_or(("0", "0"));
                    let _ = write!(out, r#"<circle cx="{cx}" cy="{cy}" r="3" fill="{colour}"/>"#);
                }
            }
            let names: Vec<&str> = series.iter().map(|(n, _)| n.as_str()).collect();
            legend(&mut out, &names);
        }
    }
    out.push_str("</svg>");
    out
}

/// The figures a chart draws, as a table.
pub fn chart_table(chart: &Chart) -> Table {
    match &chart.body {
        ChartBody::Bars { categories, series } => Table {
            caption: format!("{} ({})", chart.title, chart.y_label),
            header: std::iter::once(chart.x_label.clone()).chain(series.iter().map(|(n, _)| n.clone())).collect(),
            rows: categories
                .iter()
                .enumerate()
                .map(|(c, category)| {
                    std::iter::once(category.clone())
                        .chain(series.iter().map(|(_, v)| v.get(c).copied().flatten().map_or("–".into(), figure)))
                        .collect()
                })
                .collect(),
        },
        ChartBody::Lines { series } => Table {
            // One row per point: its series, then x and y with their units.
            caption: chart.title.clone(),
            header: vec!["series".to_string(), chart.x_label.clone(), chart.y_label.clone()],
            rows: series
                .iter()
                .flat_map(|(name, points)| points.iter().map(move |&(x, y)| vec![name.clone(), figure(x), figure(y)]))
                .collect(),
        },
    }
}

fn table_html(out: &mut String, table: &Table) {
    let _ = write!(out, "<table><caption>{}</caption>", escape(&table.caption));
    if table.header.iter().any(|cell| !cell.is_empty()) {
        out.push_str("<thead><tr>");
        for cell in &table.header {
            let _ = write!(out, "<th>{}</th>", escape(cell));
        }
        out.push_str("</tr></thead>");
    }
    out.push_str("<tbody>");
    for row in &table.rows {
        out.push_str("<tr>");
        for cell in row {
            let _ = write!(out, "<td>{}</td>", escape(cell));
        }
        out.push_str("</tr>");
    }
    out.push_str("</tbody></table>");
}

const STYLE: &str = "body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px;color:#222;background:#fafafa;max-width:1400px}\
h1{font-size:1.6em;margin-bottom:4px}h2{border-bottom:2px solid #0072B2;padding-bottom:4px;margin-top:36px}\
.meta{color:#444;font-size:.9em}.note{background:#fff;border-left:4px solid #E69F00;padding:6px 12px;margin:8px 0}\
.pair{display:flex;flex-wrap:nowrap;gap:20px;align-items:flex-start;margin:16px 0;overflow-x:auto}\
.meta{flex-wrap:wrap}.meta td{text-align:left}\
svg{background:#fff;border:1px solid #ccc;flex:none}svg .title{font-size:15px;font-weight:600;fill:#222}\
svg .axis{font-size:13px;fill:#222}svg .tick{font-size:11px;fill:#333}\
table{border-collapse:collapse;background:#fff;font-size:.85em;margin:8px 0}caption{text-align:left;font-weight:600;padding:4px 0}\
th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#eef3f8}td:first-child,th:first-child{text-align:left}";

/// The whole page: heading, machine and build tables, then each section.
pub fn page(title: &str, meta: &[Table], sections: &[Section]) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{t}</title><style>{STYLE}</style></head><body><h1>{t}</h1>",
        t = escape(title)
    );
    out.push_str("<div class=\"pair meta\">");
    for table in meta {
        table_html(&mut out, table);
    }
    out.push_str("</div>");
    for section in sections {
        let _ = write!(out, "<h2>{}</h2>", escape(&section.title));
        for note in &section.notes {
            let _ = write!(out, "<p class=\"note\">{}</p>", escape(note));
        }
        for chart in &section.charts {
            out.push_str("<div class=\"pair\">");
            out.push_str(&svg(chart));
            table_html(&mut out, &chart_table(chart));
            out.push_str("</div>");
        }
        for table in &section.tables {
            table_html(&mut out, table);
        }
    }
    out.push_str("</body></html>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tick_labels_drop_trailing_zeros() {
        assert_eq!(
            [tick_label(0.0), tick_label(2.0), tick_label(0.25), tick_label(1000.0)],
            ["0", "2", "0.25", "1000"]
        );
    }

    #[test]
    fn ticks_cover_the_range_in_round_steps() {
        let t = ticks(0.0, 37.0);
        assert_eq!(t.first(), Some(&0.0));
        assert!(*t.last().unwrap() >= 37.0, "{t:?}");
        assert!(t.len() <= 8, "{t:?}");
    }

    #[test]
    fn a_chart_is_an_svg_of_nonzero_size_with_labelled_axes() {
        let chart = Chart {
            title: "t".into(),
            x_label: "shape".into(),
            y_label: "GFLOP/s".into(),
            body: ChartBody::Bars { categories: vec!["a<b".into()], series: vec![("s".into(), vec![Some(2.0)])] },
        };
        let svg = svg(&chart);
        assert!(svg.starts_with("<svg") && svg.contains("width=\"640\"") && svg.contains("GFLOP/s"));
        assert!(svg.contains("a&lt;b") && !svg.contains("a<b"));
    }
}
