//! plotters' SVG rewritten into what every renderer draws alike: librsvg, browsers, and
//! ImageMagick's own renderer (MSVG, what `convert` uses where librsvg is not its delegate),
//! which takes only a plain subset of SVG. What MSVG (ImageMagick 6.9) does with plotters'
//! output, and what this module writes instead:
//!
//! - `opacity` is ignored (a translucent band or a faint grid line comes out solid), and on a
//!   polyline with `fill="none"` it fills the polyline black: every colour is blended with the
//!   white page here, and no element carries `opacity`.
//! - `dy` in `em`/`ex` is ignored (a title at the top is cut off above the page, every label
//!   sits lower): the shift is added to `y` in px, as DejaVu Sans sets it.
//! - text without `stroke="none"` is stroked (every word bold).
//! - `font-family="sans-serif"` resolves to Helvetica's Type 1 files, and where those are not
//!   installed no text is drawn at all: the attribute names DejaVu Sans, which MSVG finds
//!   through fontconfig; a `<style>` rule, which MSVG ignores and CSS renderers prefer to the
//!   attribute, gives browsers and librsvg the usual list ending in `sans-serif`.
//!
//! Rotated text MSVG turns the wrong way and does not anchor, so the report draws none
//! (`canvas::axis_unit` writes a vertical axis's unit level above it).

/// DejaVu Sans's x-height, in em: what `ex` is in the fonts that `sans-serif` resolves to.
const EX_PER_EM: f64 = 0.55;

/// The font every renderer can find: DejaVu Sans (Linux's `sans-serif`), which MSVG reaches
/// through fontconfig; CSS renderers fall back along the list where it is missing.
const FONT_RULE: &str =
    "<style>text { font-family: \"DejaVu Sans\", Verdana, Arial, Helvetica, sans-serif }</style>";

/// Rewrites plotters' SVG document, element by element (plotters writes one per line, a
/// text's content on the lines between its tags).
pub(super) fn portable(svg: &str) -> String {
    let mut out = String::with_capacity(svg.len() + 256);
    for line in svg.lines() {
        if line.starts_with("<svg") {
            out.push_str(line);
            out.push('\n');
            out.push_str(FONT_RULE);
        } else if line.starts_with('<') && !line.starts_with("</") {
            out.push_str(&element(line));
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

/// One opening tag rewritten: opacity blended into its colours, a text's `dy` into its `y`,
/// its font named and its stroke off.
fn element(tag: &str) -> String {
    let opacity = attribute(tag, "opacity").and_then(|o| o.parse::<f64>().ok());
    let mut tag = remove(tag, "opacity");
    if let Some(opacity) = opacity {
        for name in ["fill", "stroke"] {
            if let Some(color) = attribute(&tag, name).and_then(|c| blend(c, opacity)) {
                tag = set(&tag, name, &color);
            }
        }
    }
    if tag.starts_with("<text") {
        let size = attribute(&tag, "font-size").and_then(|s| s.parse::<f64>().ok());
        let dy = attribute(&tag, "dy").and_then(|dy| size.and_then(|size| px(dy, size)));
        let y = attribute(&tag, "y").and_then(|y| y.parse::<f64>().ok());
        if let (Some(dy), Some(y)) = (dy, y) {
            tag = set(&remove(&tag, "dy"), "y", &format!("{:.1}", y + dy));
        }
        tag = set(&tag, "font-family", "DejaVu Sans");
        tag = tag.replacen("<text ", "<text stroke=\"none\" ", 1);
    }
    tag
}

/// A length in `em` or `ex` of a font `size` px, in px.
fn px(length: &str, size: f64) -> Option<f64> {
    if let Some(em) = length.strip_suffix("em") {
        return em.parse::<f64>().ok().map(|em| em * size);
    }
    let ex = length.strip_suffix("ex")?;
    ex.parse::<f64>().ok().map(|ex| ex * EX_PER_EM * size)
}

/// `#RRGGBB` drawn at `opacity` over white, as an opaque colour.
pub(super) fn blend(color: &str, opacity: f64) -> Option<String> {
    let hex = color.strip_prefix('#').filter(|h| h.len() == 6)?;
    let channel = |i: usize| u8::from_str_radix(&hex[i..i + 2], 16).ok();
    let mix = |c: u8| (f64::from(c) * opacity + 255.0 * (1.0 - opacity)).round() as u8;
    let (r, g, b) = (channel(0)?, channel(2)?, channel(4)?);
    Some(format!("#{:02X}{:02X}{:02X}", mix(r), mix(g), mix(b)))
}

/// The value of attribute `name` in `tag`.
fn attribute<'a>(tag: &'a str, name: &str) -> Option<&'a str> {
    let key = format!(" {name}=\"");
    let start = tag.find(&key)? + key.len();
    let len = tag[start..].find('"')?;
    Some(&tag[start..start + len])
}

/// `tag` without attribute `name`.
fn remove(tag: &str, name: &str) -> String {
    let key = format!(" {name}=\"");
    match tag.find(&key) {
        Some(start) => {
            let value = start + key.len();
            let end = value + tag[value..].find('"').map_or(0, |l| l + 1);
            format!("{}{}", &tag[..start], &tag[end..])
        }
        None => tag.to_string(),
    }
}

/// `tag` with attribute `name` set to `value`, in its place if it had one.
fn set(tag: &str, name: &str, value: &str) -> String {
    let key = format!(" {name}=\"");
    match tag.find(&key) {
        Some(start) => {
            let value_at = start + key.len();
            let end = value_at + tag[value_at..].find('"').unwrap_or(0);
            format!("{}{value}{}", &tag[..value_at], &tag[end..])
        }
        None => {
            let at = tag.find(|c: char| c.is_whitespace()).unwrap_or(tag.len());
            format!("{} {name}=\"{value}\"{}", &tag[..at], &tag[at..])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn translucent_colours_become_solid_over_white() {
        let band = r##"<rect x="1" y="2" width="18" height="14" opacity="0.3" fill="#D62728" stroke="none"/>"##;
        assert_eq!(
            element(band),
            r##"<rect x="1" y="2" width="18" height="14" fill="#F3BEBF" stroke="none"/>"##
        );
        let grid =
            r##"<line opacity="0.2" stroke="#000000" stroke-width="1" x1="68" y1="3" x2="68"/>"##;
        assert_eq!(
            element(grid),
            r##"<line stroke="#CCCCCC" stroke-width="1" x1="68" y1="3" x2="68"/>"##
        );
        let series = r##"<polyline fill="none" opacity="1" stroke="#1F77B4" points="1,2 "/>"##;
        assert_eq!(
            element(series),
            r##"<polyline fill="none" stroke="#1F77B4" points="1,2 "/>"##
        );
    }

    #[test]
    fn text_is_placed_in_px_unstroked_in_a_named_font() {
        let title = r##"<text x="14" y="8" dy="0.76em" text-anchor="start" font-family="sans-serif" font-size="20" opacity="0.75" fill="#000000">"##;
        assert_eq!(
            element(title),
            r##"<text stroke="none" x="14" y="23.2" text-anchor="start" font-family="DejaVu Sans" font-size="20" fill="#404040">"##
        );
        let tick = r##"<text x="5" y="100" dy="-0.5ex" font-size="12" fill="#000000">"##;
        assert!(element(tick).contains(r#" y="96.7""#), "{}", element(tick));
    }

    #[test]
    fn the_document_gets_the_font_rule_and_keeps_its_text() {
        let svg = "<svg width=\"10\" height=\"10\">\n<text x=\"1\" y=\"1\" font-size=\"10\">\nhello\n</text>\n</svg>\n";
        let out = portable(svg);
        assert!(
            out.starts_with("<svg width=\"10\" height=\"10\">\n<style>"),
            "{out}"
        );
        assert!(out.contains("\nhello\n</text>\n</svg>\n"), "{out}");
    }
}
