//! Text laid out by its estimated width, so that no label runs past its chart or into the next
//! run's column: plotters can draw text in SVG but cannot measure it (the viewer picks the
//! font), so the report estimates widths and flows, wraps or truncates its lines to fit.

/// plotters writes a font of `f` px into SVG as `font-size` f / 1.24.
pub(super) const SVG_FONT_SCALE: f64 = 1.24;

/// A character's advance in em, by class, from DejaVu Sans (what `sans-serif` resolves to on
/// most Linux viewers, and wider than Helvetica or Arial, so an estimate that fits it fits
/// them): i, l, punctuation and space about 0.3; digits and most lower case 0.61-0.64; upper
/// case up to 0.77; m, w, M, W and % near 1.
pub(super) fn em_width(text: &str) -> f64 {
    text.chars()
        .map(|c| match c {
            'i' | 'j' | 'l' | 'I' | '.' | ',' | ':' | ';' | '\'' | '!' | '|' | ' ' | '·' => 0.32,
            'f' | 't' | 'r' | '(' | ')' | '[' | ']' | '-' | '/' => 0.41,
            'm' | 'w' | 'M' | 'W' | '%' | '@' | '—' | '…' => 1.0,
            'A'..='Z' | '×' => 0.78,
            _ => 0.64,
        })
        .sum()
}

/// Estimated width in pixels of `text` drawn at `font` px (as plotters takes font sizes).
pub(super) fn text_width(text: &str, font: u32) -> i32 {
    (em_width(text) * f64::from(font) / SVG_FONT_SCALE).ceil() as i32
}

/// `text` cut to fit `width` pixels at `font`, ending in "…" when it was cut.
pub(super) fn truncate(text: &str, width: i32, font: u32) -> String {
    if text_width(text, font) <= width {
        return text.to_string();
    }
    let mut out: String = text.chars().collect();
    while !out.is_empty() && text_width(&format!("{out}…"), font) > width {
        out.pop();
    }
    format!("{}…", out.trim_end())
}

/// `pieces` joined by `sep` into as few lines as fit: the first `width` pixels wide at `font`,
/// the rest `indent` pixels narrower (the caller draws them indented: SVG collapses leading
/// spaces). A piece too long for a line of its own is truncated.
pub(super) fn flow(
    pieces: &[String],
    sep: &str,
    width: i32,
    indent: i32,
    font: u32,
) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    let mut line = String::new();
    for piece in pieces {
        let room = if lines.is_empty() {
            width
        } else {
            width - indent
        };
        let joined = match line.is_empty() {
            true => piece.clone(),
            false => format!("{line}{sep}{piece}"),
        };
        if line.is_empty() || text_width(joined.trim_end(), font) <= room {
            line = joined;
            continue;
        }
        lines.push(truncate(line.trim_end(), room, font));
        line = piece.clone();
    }
    if !line.is_empty() {
        let room = if lines.is_empty() {
            width
        } else {
            width - indent
        };
        lines.push(truncate(line.trim_end(), room, font));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| w.to_string()).collect()
    }

    #[test]
    fn flowed_lines_fit_and_keep_every_piece_in_order() {
        let words = pieces(&["vcpu 0 0.120 ms"; 30]);
        let lines = flow(&words, ", ", 300, 40, 13);
        assert!(lines.len() > 1, "{lines:?}");
        assert!(text_width(&lines[0], 13) <= 300, "{lines:?}");
        assert!(
            lines[1..].iter().all(|l| text_width(l, 13) <= 260),
            "{lines:?}"
        );
        let rejoined: Vec<&str> = lines.iter().flat_map(|l| l.split(", ")).collect();
        assert_eq!(rejoined, vec!["vcpu 0 0.120 ms"; 30]);
    }

    #[test]
    fn a_piece_wider_than_the_line_is_cut_with_an_ellipsis() {
        let long = "x".repeat(400);
        assert_eq!(flow(&pieces(&[&long]), " ", 200, 0, 13).len(), 1);
        let cut = truncate(&long, 200, 13);
        assert!(cut.ends_with('…') && text_width(&cut, 13) <= 200, "{cut}");
        assert_eq!(truncate("short", 200, 13), "short");
    }
}
