//! Line charts as SVG, for the figures in docs/benchmarks.md (`cannabis testnet plot`).
//!
//! Hand-written rather than a plotting crate: a chart here is a few axes, ticks and
//! polylines, about a hundred lines, where the plotting crates bring font rendering and
//! image back ends this project has no other use for.

use std::fmt::Write as _;

/// One line of a chart.
#[derive(Clone, Debug)]
pub struct Series {
    /// Its name, in the legend.
    pub name: String,
    /// `(x, y)` points, in x order.
    pub points: Vec<(f64, f64)>,
}

/// A chart's frame.
#[derive(Clone, Debug)]
pub struct Chart {
    /// The title.
    pub title: String,
    /// The x axis's label.
    pub x_label: String,
    /// The y axis's label.
    pub y_label: String,
    /// A logarithmic x axis (base 10).
    pub log_x: bool,
    /// A logarithmic y axis (base 10).
    pub log_y: bool,
}

const W: f64 = 720.0;
const H: f64 = 440.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 200.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 60.0;
const COLOURS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
];

/// Ticks for `[lo, hi]`, from one at or below `lo` to one at or above `hi`: on a log axis
/// 1, 2 and 5 times the powers of ten (the powers alone over more than two decades),
/// otherwise about five round steps.
fn ticks(lo: f64, hi: f64, log: bool) -> Vec<f64> {
    if log {
        let (a, b) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
        let steps: &[f64] = if b - a > 2 { &[1.0] } else { &[1.0, 2.0, 5.0] };
        let all: Vec<f64> = (a..=b)
            .flat_map(|e| steps.iter().map(move |m| m * 10f64.powi(e)))
            .collect();
        let first = all
            .iter()
            .rposition(|v| *v <= lo * (1.0 + 1e-9))
            .unwrap_or(0);
        let last = all
            .iter()
            .position(|v| *v >= hi * (1.0 - 1e-9))
            .unwrap_or(all.len() - 1);
        return all[first..=last].to_vec();
    }
    let span = (hi - lo).max(f64::MIN_POSITIVE);
    let raw = span / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let first = (lo / step).floor() as i64;
    let last = (hi / step).ceil() as i64;
    (first..=last).map(|k| k as f64 * step).collect()
}

fn label(v: f64) -> String {
    if v.abs() >= 1000.0 && v.fract() == 0.0 {
        let s = format!("{}", v as i64);
        // Thousands separated, as the docs write numbers.
        let mut out = String::new();
        for (i, c) in s.chars().rev().enumerate() {
            if i > 0 && i % 3 == 0 && c != '-' {
                out.push(',');
            }
            out.push(c);
        }
        out.chars().rev().collect()
    } else if v.fract() == 0.0 {
        format!("{}", v as i64)
    } else {
        format!("{v:.2}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_string()
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The chart as an SVG document. Points that a log axis cannot show (zero or less) are
/// left out.
pub fn svg(chart: &Chart, series: &[Series]) -> String {
    let shown = |(x, y): &(f64, f64)| (!chart.log_x || *x > 0.0) && (!chart.log_y || *y > 0.0);
    let all: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .filter(shown)
        .collect();
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for (x, y) in &all {
        (x0, x1, y0, y1) = (x0.min(*x), x1.max(*x), y0.min(*y), y1.max(*y));
    }
    if all.is_empty() {
        (x0, x1, y0, y1) = (1.0, 10.0, 1.0, 10.0);
    }
    if !chart.log_y {
        y0 = y0.min(0.0);
    }
    let xt = ticks(x0, x1, chart.log_x);
    let yt = ticks(y0, y1, chart.log_y);
    let (x0, x1) = (xt[0], *xt.last().unwrap_or(&x1));
    let (y0, y1) = (yt[0], *yt.last().unwrap_or(&y1));
    let f = |v: f64, lo: f64, hi: f64, log: bool| {
        if log {
            (v.log10() - lo.log10()) / (hi.log10() - lo.log10()).max(f64::MIN_POSITIVE)
        } else {
            (v - lo) / (hi - lo).max(f64::MIN_POSITIVE)
        }
    };
    let px = |x: f64| LEFT + f(x, x0, x1, chart.log_x) * (W - LEFT - RIGHT);
    let py = |y: f64| H - BOTTOM - f(y, y0, y1, chart.log_y) * (H - TOP - BOTTOM);

    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="28" font-size="15" text-anchor="middle">{}</text>"#,
        (LEFT + W - RIGHT) / 2.0,
        escape(&chart.title)
    );
    for x in &xt {
        let p = px(*x);
        let _ = writeln!(
            s,
            r##"<line x1="{p:.1}" y1="{TOP}" x2="{p:.1}" y2="{}" stroke="#e0e0e0"/><text x="{p:.1}" y="{}" text-anchor="middle">{}</text>"##,
            H - BOTTOM,
            H - BOTTOM + 18.0,
            label(*x)
        );
    }
    for y in &yt {
        let p = py(*y);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{p:.1}" x2="{}" y2="{p:.1}" stroke="#e0e0e0"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            W - RIGHT,
            LEFT - 6.0,
            p + 4.0,
            label(*y)
        );
    }
    let _ = writeln!(
        s,
        r##"<rect x="{LEFT}" y="{TOP}" width="{}" height="{}" fill="none" stroke="#444"/>"##,
        W - LEFT - RIGHT,
        H - TOP - BOTTOM
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        (LEFT + W - RIGHT) / 2.0,
        H - 18.0,
        escape(&chart.x_label)
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate(20,{}) rotate(-90)" text-anchor="middle">{}</text>"#,
        (TOP + H - BOTTOM) / 2.0,
        escape(&chart.y_label)
    );
    for (i, series) in series.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let points: Vec<String> = series
            .points
            .iter()
            .filter(|p| shown(p))
            .map(|(x, y)| format!("{:.1},{:.1}", px(*x), py(*y)))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="2"/>"#,
            points.join(" ")
        );
        for p in &points {
            let (x, y) = p.split_once(',').unwrap_or(("0", "0"));
            let _ = writeln!(s, r#"<circle cx="{x}" cy="{y}" r="3" fill="{colour}"/>"#);
        }
        let ly = TOP + 10.0 + 20.0 * i as f64;
        let _ = writeln!(
            s,
            r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{colour}" stroke-width="2"/><text x="{}" y="{}">{}</text>"#,
            W - RIGHT + 12.0,
            W - RIGHT + 32.0,
            W - RIGHT + 38.0,
            ly + 4.0,
            escape(&series.name)
        );
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(ticks(0.0, 9.3, false), [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        assert_eq!(ticks(10.0, 100.0, true), [10.0, 20.0, 50.0, 100.0]);
        assert_eq!(ticks(3.0, 7.4, true), [2.0, 5.0, 10.0]);
        assert_eq!(ticks(12.0, 3000.0, true), [10.0, 100.0, 1000.0, 10000.0]);
        assert_eq!(label(24000.0), "24,000");
        assert_eq!(label(0.25), "0.25");
    }

    #[test]
    fn a_chart_has_a_line_and_a_legend_entry_per_series_in_its_frame() {
        let chart = Chart {
            title: "p50 & p99".into(),
            x_label: "nodes".into(),
            y_label: "ms".into(),
            log_x: true,
            log_y: false,
        };
        let series = [
            Series {
                name: "p50".into(),
                points: vec![(10.0, 3.0), (50.0, 21.0), (100.0, 40.0)],
            },
            Series {
                name: "p99".into(),
                // A point a log axis cannot show is left out.
                points: vec![(0.0, 1.0), (10.0, 9.0), (100.0, 90.0)],
            },
        ];
        let svg = svg(&chart, &series);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert_eq!(svg.matches("<circle").count(), 5);
        assert!(svg.contains("p50 &amp; p99"));
        // Every point inside the plotting area.
        for c in svg.lines().filter(|l| l.starts_with("<circle")) {
            let num = |key: &str| -> f64 {
                let v = c.split(&format!("{key}=\"")).nth(1).unwrap();
                v[..v.find('"').unwrap()].parse().unwrap()
            };
            assert!((LEFT..=W - RIGHT).contains(&num("cx")), "{c}");
            assert!((TOP..=H - BOTTOM).contains(&num("cy")), "{c}");
        }
    }
}
