//! Tests of what `ferry report` draws, read back from its SVG: for every kind of run (see
//! `fixtures.rs`), the bars have height, the bands span what they stand for, the labels say
//! what happened, and no text runs past the picture or into another run's column.
//!
//! plotters writes one element a line (`<rect x=".." .../>`, `<text ...>` then its content),
//! so a few lines of scanning read it back; text extents are estimated with the same
//! per-character widths the layout uses (`layout::em_width`), from the `font-size` written.

use ferry_migrate::{MigrationStats, Phase};

use super::canvas::CAPTION_FONT;
use super::fixtures;
use super::layout::{SVG_FONT_SCALE, em_width};
use super::plot::{COLUMN_WIDTH, Run, render};
use super::portable::blend;

/// One SVG element: its name, attributes and text content.
#[derive(Clone, Debug)]
struct Element {
    name: String,
    attrs: Vec<(String, String)>,
    text: String,
}

impl Element {
    fn attr(&self, key: &str) -> Option<&str> {
        self.attrs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    fn num(&self, key: &str) -> f64 {
        self.attr(key)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{key} of {self:?}"))
    }
}

/// The elements of an SVG document, in order.
fn elements(svg: &str) -> Vec<Element> {
    let mut out = Vec::new();
    let mut rest = svg;
    while let Some(open) = rest.find('<') {
        rest = &rest[open + 1..];
        let close = rest.find('>').expect("every tag closes");
        let tag = &rest[..close];
        rest = &rest[close + 1..];
        if tag.starts_with(['/', '?', '!']) {
            continue;
        }
        let tag = tag.trim_end_matches('/');
        let (name, mut attrs_text) = tag.split_once(' ').unwrap_or((tag, ""));
        let mut attrs = Vec::new();
        while let Some((key, after)) = attrs_text.split_once("=\"") {
            let (value, after) = after.split_once('"').expect("attribute values are quoted");
            attrs.push((key.trim().to_string(), unescape(value)));
            attrs_text = after;
        }
        let mut text = String::new();
        if name == "text" {
            let end = rest.find("</text>").expect("text closes");
            text = unescape(rest[..end].trim());
            rest = &rest[end..];
        }
        out.push(Element {
            name: name.to_string(),
            attrs,
            text,
        });
    }
    out
}

fn unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&amp;", "&")
}

/// Where a text element's glyphs are estimated to lie.
#[derive(Clone, Debug)]
struct TextBox {
    text: String,
    x0: f64,
    x1: f64,
    y0: f64,
    y1: f64,
}

impl TextBox {
    fn of(e: &Element) -> TextBox {
        let size = e.num("font-size");
        let (x, y) = (e.num("x"), e.num("y"));
        let width = em_width(&e.text) * size;
        let start = match e.attr("text-anchor") {
            Some("middle") => x - width / 2.0,
            Some("end") => x - width,
            _ => x,
        };
        // `portable.rs` writes every text's y as its baseline, 0.76 em under its top.
        let top = y - 0.76 * size;
        let text = e.text.clone();
        TextBox {
            text,
            x0: start,
            x1: start + width,
            y0: top,
            y1: top + size,
        }
    }

    fn overlaps(&self, other: &TextBox) -> bool {
        self.x0 < other.x1 && other.x0 < self.x1 && self.y0 < other.y1 && other.y0 < self.y1
    }

    /// The column of the point text is anchored at.
    fn column(&self) -> usize {
        ((self.x0 + self.x1) / 2.0 / f64::from(COLUMN_WIDTH)) as usize
    }
}

/// A rendered report, read back.
struct Drawn {
    width: f64,
    elements: Vec<Element>,
}

impl Drawn {
    fn of(stats: &[(&str, MigrationStats)]) -> Drawn {
        let runs: Vec<Run> = stats
            .iter()
            .map(|(name, stats)| Run {
                name: name.to_string(),
                stats: stats.clone(),
                disk: None,
            })
            .collect();
        Drawn::of_runs(&runs)
    }

    fn of_runs(runs: &[Run]) -> Drawn {
        let svg = render(runs).expect("the report renders");
        let elements = elements(&svg);
        let width = elements
            .iter()
            .find(|e| e.name == "svg")
            .expect("an svg element")
            .num("width");
        Drawn { width, elements }
    }

    fn texts(&self) -> Vec<TextBox> {
        let texts = self.elements.iter().filter(|e| e.name == "text");
        texts.map(TextBox::of).collect()
    }

    /// The elements of the chart whose title starts with `caption` in `column`: from that
    /// title down to the next chart's.
    fn chart(&self, caption: &str, column: usize) -> Vec<&Element> {
        let in_column = |e: &&Element| {
            let x = e.attr("x").and_then(|x| x.parse::<f64>().ok()).or_else(|| {
                let points = e.attr("points")?;
                points.split([',', ' ']).next()?.parse().ok()
            });
            x.is_some_and(|x| (x / f64::from(COLUMN_WIDTH)) as usize == column)
        };
        let caption_size = f64::from(CAPTION_FONT) / SVG_FONT_SCALE;
        let titles: Vec<(f64, &str)> = self
            .elements
            .iter()
            .filter(in_column)
            .filter(|e| e.name == "text" && e.num("font-size") == caption_size)
            .map(|e| (TextBox::of(e).y0, e.text.as_str()))
            .collect();
        let (i, &(top, _)) = titles
            .iter()
            .enumerate()
            .find(|(_, t)| t.1.starts_with(caption))
            .unwrap_or_else(|| panic!("no chart {caption} in column {column}: {titles:?}"));
        let bottom = titles.get(i + 1).map_or(f64::INFINITY, |t| t.0);
        self.elements
            .iter()
            .filter(in_column)
            .filter(|e| {
                // A text by its top, as the titles are.
                let y = match e.name.as_str() {
                    "text" => Some(TextBox::of(e).y0),
                    _ => e.attr("y").and_then(|y| y.parse::<f64>().ok()),
                };
                y.is_some_and(|y| y >= top && y < bottom)
            })
            .collect()
    }

    /// Rectangles of a chart filled with `fill` (`#RRGGBB`).
    fn rects<'a>(chart: &[&'a Element], fill: &str) -> Vec<&'a Element> {
        chart
            .iter()
            .copied()
            .filter(|e| e.name == "rect" && e.attr("fill") == Some(fill))
            .collect()
    }

    /// Pixels per second on the timeline of `column`, from two of its time axis's labels.
    fn px_per_s(&self, column: usize) -> f64 {
        let chart = self.chart("Timeline", column);
        let ticks: Vec<(f64, f64)> = chart
            .iter()
            .filter(|e| e.name == "text" && e.attr("text-anchor") == Some("middle"))
            .filter_map(|e| Some((e.text.parse::<f64>().ok()?, e.num("x"))))
            .collect();
        let (first, last) = (ticks[0], ticks[ticks.len() - 1]);
        assert!(last.0 > first.0, "{ticks:?}");
        (last.1 - first.1) / (last.0 - first.0)
    }

    fn has_text(&self, part: &str) -> bool {
        self.texts().iter().any(|t| t.text.contains(part))
    }
}

/// A band of the timeline: its colour as `timeline.rs` mixes it, blended with the page.
fn band(color: &str) -> String {
    let opacity = match color {
        RED => 0.25,
        TEAL => 0.15,
        _ => 0.3,
    };
    blend(color, opacity).expect("a #RRGGBB colour")
}

const RED: &str = "#D62728";
const TEAL: &str = "#17BECF";
const GREY: &str = "#7F7F7F";
const BLUE: &str = "#1F77B4";

fn every_kind() -> Vec<(&'static str, MigrationStats)> {
    vec![
        ("precopy", fixtures::precopy()),
        ("postcopy", fixtures::postcopy()),
        ("recovered", fixtures::recovered()),
        ("cancelled", fixtures::cancelled()),
        ("throttled", fixtures::throttled()),
    ]
}

/// Every text of `drawn` inside the picture and inside its own column.
fn assert_text_within_columns(drawn: &Drawn) {
    for t in drawn.texts() {
        let column = t.column() as f64 * f64::from(COLUMN_WIDTH);
        let (left, right) = (column, (column + f64::from(COLUMN_WIDTH)).min(drawn.width));
        assert!(
            t.x0 >= left && t.x1 <= right,
            "{:?} spans {:.0}..{:.0} px, past its column {left:.0}..{right:.0}",
            t.text,
            t.x0,
            t.x1
        );
    }
}

#[test]
fn the_downtime_bar_of_every_run_that_paused_has_height() {
    for (name, stats) in every_kind() {
        let drawn = Drawn::of(&[(name, stats.clone())]);
        let chart = drawn.chart("Downtime", 0);
        let parts = super::charts::downtime_parts(&stats.downtime);
        let bar: Vec<&Element> = chart
            .iter()
            .copied()
            .filter(|e| e.name == "rect" && e.num("width") > 12.0)
            .filter(|e| parts.iter().any(|p| e.attr("fill") == Some(&hex(p.2))))
            .collect();
        if stats.downtime.total_ms == 0.0 {
            assert!(bar.is_empty(), "{name}: {bar:?}");
            assert!(drawn.has_text("the guest was not paused"), "{name}");
            continue;
        }
        assert!(!bar.is_empty(), "{name}: no downtime bar");
        for rect in bar {
            assert!(rect.num("height") >= 20.0, "{name}: {rect:?}");
        }
    }
}

fn hex(c: plotters::style::RGBColor) -> String {
    format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2)
}

#[test]
fn no_text_runs_past_the_picture_for_any_kind_of_run() {
    for (name, stats) in every_kind() {
        assert_text_within_columns(&Drawn::of(&[(name, stats)]));
    }
}

#[test]
fn the_state_lines_wrap_under_the_downtime_bar() {
    let drawn = Drawn::of(&[("precopy", fixtures::precopy())]);
    let lines: Vec<String> = drawn
        .chart("Downtime", 0)
        .iter()
        .filter(|e| e.name == "text")
        .map(|e| e.text.clone())
        .collect();
    let save = lines.iter().position(|l| l.starts_with("save: 8 vCPUs"));
    let load = lines.iter().position(|l| l.starts_with("load: 8 vCPUs"));
    let (save, load) = (save.expect("a save line"), load.expect("a load line"));
    assert!(load > save + 1, "the save line wraps: {lines:?}");
    assert!(lines.last().unwrap().contains("telemetry"), "{lines:?}");
}

#[test]
fn a_histogram_of_few_requests_labels_each_count_once() {
    // Issue 55: counts up to 3 put a tick every half request, and each was rounded, so the
    // axis read "0 0 1 2 2 2 3".
    let mut stats = fixtures::postcopy();
    let pc = stats.postcopy.as_mut().expect("postcopy");
    pc.latency_buckets = vec![0; 32];
    pc.latency_buckets[6..9].copy_from_slice(&[1, 3, 2]);
    let drawn = Drawn::of(&[("few", stats)]);
    let counts: Vec<&str> = drawn
        .chart("Postcopy fault to page", 0)
        .iter()
        .filter(|e| e.name == "text" && e.attr("text-anchor") == Some("end"))
        .map(|e| e.text.as_str())
        .filter(|text| !text.is_empty())
        .collect();
    assert_eq!(counts, ["0", "1", "2", "3", "requests"]);
}

#[test]
fn the_latency_histogram_has_one_bar_per_non_empty_bucket() {
    let stats = fixtures::postcopy();
    let drawn = Drawn::of(&[("postcopy", stats.clone())]);
    let chart = drawn.chart("Postcopy fault to page", 0);
    let mut bars = Drawn::rects(&chart, BLUE);
    // The legend's swatch is the 12 px square in the header.
    bars.retain(|r| r.num("width") != 12.0 || r.num("height") != 12.0);
    let buckets = &stats.postcopy.unwrap().latency_buckets;
    let filled: Vec<u64> = buckets.iter().copied().filter(|&c| c > 0).collect();
    assert_eq!(bars.len(), filled.len(), "{bars:?}");
    // Left to right as the buckets, each as tall as its count.
    bars.sort_by(|a, b| a.num("x").total_cmp(&b.num("x")));
    let tallest = bars.iter().map(|b| b.num("height")).fold(0.0, f64::max);
    for (bar, &count) in bars.iter().zip(&filled) {
        let expected = count as f64 / 1500.0 * tallest;
        assert!(
            (bar.num("height") - expected).abs() <= 1.5,
            "{bar:?} for {count}"
        );
    }
    // The empty 512 µs bucket between 256 µs and 1 ms leaves a gap of one bar.
    let (b256, b1024) = (bars[2], bars[3]);
    assert!(b1024.num("x") - (b256.num("x") + b256.num("width")) > b256.num("width"));
    assert!(drawn.has_text("p50 256 µs, p99 2.0 ms"));
}

#[test]
fn a_precopy_only_report_has_no_latency_chart() {
    let drawn = Drawn::of(&[("precopy", fixtures::precopy())]);
    assert!(!drawn.has_text("Postcopy fault to page"));
}

#[test]
fn a_run_with_predictions_draws_them_against_its_total_and_one_without_does_not() {
    let drawn = Drawn::of(&[("precopy", fixtures::precopy())]);
    assert!(drawn.has_text("Predicted total (actual 3030 ms)"));
    assert!(drawn.has_text("predicted at the pass end"));
    let drawn = Drawn::of(&[("throttled", fixtures::throttled())]);
    assert!(!drawn.has_text("Predicted total (actual 3030 ms)"));
}

#[test]
fn a_postcopy_run_is_labelled_postcopy_with_its_trigger_not_forced_switchover() {
    for (name, stats) in [
        ("postcopy", fixtures::postcopy()),
        ("recovered", fixtures::recovered()),
    ] {
        let drawn = Drawn::of(&[(name, stats)]);
        assert!(drawn.has_text("postcopy after pass 2 (policy)"), "{name}");
        assert!(!drawn.has_text("forced switchover"), "{name}");
        assert!(!drawn.has_text("converged"), "{name}");
    }
    let drawn = Drawn::of(&[("recovered", fixtures::recovered())]);
    assert!(drawn.has_text("recovered 1× after 500 ms paused"));
}

#[test]
fn the_paused_band_spans_the_downtime_and_postcopy_has_a_band_of_its_own() {
    for (name, stats) in every_kind() {
        let drawn = Drawn::of(&[(name, stats.clone())]);
        let chart = drawn.chart("Timeline", 0);
        let px_per_s = drawn.px_per_s(0);
        let width_of = |fill| {
            Drawn::rects(&chart, &band(fill))
                .iter()
                // The legend's swatch is 18 px wide, in the header above the plot.
                .filter(|r| r.num("height") > 40.0)
                .map(|r| r.num("width"))
                .collect::<Vec<f64>>()
        };
        let near = |px: f64, s: f64| (px - s * px_per_s).abs() <= 2.0;
        let paused = width_of(RED);
        if stats.downtime.total_ms > 0.0 {
            assert_eq!(paused.len(), 1, "{name}: {paused:?}");
            assert!(
                near(paused[0], 0.120),
                "{name}: {paused:?} at {px_per_s} px/s"
            );
        } else {
            assert!(paused.is_empty(), "{name}: {paused:?}");
        }
        let postcopy = width_of(TEAL);
        if stats.postcopy.is_some() {
            assert_eq!(postcopy.len(), 1, "{name}: {postcopy:?}");
            assert!(near(postcopy[0], 4.0 - 2.3), "{name}: {postcopy:?}");
            assert!(drawn.has_text("guest runs on destination, pages fetched"));
        } else {
            assert!(postcopy.is_empty(), "{name}: {postcopy:?}");
        }
        let broken = width_of(GREY);
        match name {
            "recovered" => assert!(broken.len() == 1 && near(broken[0], 0.5), "{broken:?}"),
            _ => assert!(broken.is_empty(), "{name}: {broken:?}"),
        }
    }
}

#[test]
fn a_cancelled_or_failed_run_says_so_and_where() {
    let mut failed = fixtures::cancelled();
    failed.timeline.last_mut().expect("a timeline").phase = Phase::Failed;
    for (stats, title, mark) in [
        (fixtures::cancelled(), "cancelled in pass 2", "cancelled"),
        (failed, "failed in precopy", "failed"),
    ] {
        let drawn = Drawn::of(&[("run", stats)]);
        assert!(drawn.has_text(title), "{title}");
        assert!(!drawn.has_text("forced switchover"));
        let timeline = drawn.chart("Timeline", 0);
        let marks = timeline
            .iter()
            .filter(|e| e.name == "text" && e.text == mark);
        assert_eq!(marks.count(), 1, "{mark}");
    }
}

#[test]
fn a_throttled_run_says_how_far_it_was_throttled() {
    let drawn = Drawn::of(&[("throttled", fixtures::throttled())]);
    assert!(drawn.has_text("throttled up to 40%"));
    assert!(drawn.has_text("converged"));
}

#[test]
fn runs_side_by_side_keep_their_text_apart() {
    let long = "a run named after a benchmark scenario with a long description, 1G ws @ 400 MB/s";
    let kinds = every_kind();
    for pair in kinds.windows(2) {
        let drawn = Drawn::of(&[(long, pair[0].1.clone()), (pair[1].0, pair[1].1.clone())]);
        assert_text_within_columns(&drawn);
        let texts = drawn.texts();
        for a in texts.iter().filter(|t| t.column() == 0) {
            for b in texts.iter().filter(|t| t.column() == 1) {
                assert!(!a.overlaps(b), "{a:?} overlaps {b:?}");
            }
        }
    }
}

#[test]
fn no_two_texts_of_a_run_overlap() {
    for (name, stats) in every_kind() {
        let texts = Drawn::of(&[(name, stats)]).texts();
        for (i, a) in texts.iter().enumerate() {
            for b in &texts[i + 1..] {
                assert!(!a.overlaps(b), "{name}: {a:?} overlaps {b:?}");
            }
        }
    }
}

#[test]
fn a_disk_copy_run_names_its_disk_figures_in_its_title() {
    let run = Run {
        name: "disk copy".into(),
        stats: fixtures::precopy(),
        disk: Some(fixtures::disk_copy()),
    };
    let drawn = Drawn::of_runs(&[run]);
    for piece in [
        "disk copy: 24.0 MB of data and 8.0 MB as zeros in 12 chunks",
        "3 dirty passes (700 blocks sent again)",
        "0.1 MB left",
        "the mirror on, holding the guest's writes 40 ms",
    ] {
        assert!(drawn.has_text(piece), "{piece:?} in the title");
    }
    assert_text_within_columns(&drawn);
    let texts = drawn.texts();
    for (i, a) in texts.iter().enumerate() {
        for b in &texts[i + 1..] {
            assert!(!a.overlaps(b), "{a:?} overlaps {b:?}");
        }
    }
}
