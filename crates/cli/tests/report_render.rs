//! `ferry report`'s SVG looks the same through the three renderers its readers use: librsvg
//! (`rsvg-convert`: GNOME, GitLab, most converters), ImageMagick's own renderer (MSVG, what
//! `convert` uses where librsvg is not its delegate) and a browser (headless Chromium, the SVG
//! as an `<img>`). Each rasterizes one report of two runs side by side, a precopy run and a
//! postcopy run (so every chart kind is drawn, the latency histogram too); the pictures are
//! compared in tiles of grey.
//!
//! Why tiles: the renderers pick fonts, hint glyphs and anti-alias edges each their own way,
//! so pixels differ at every letter and line; what must not differ is where ink is. A tile of
//! `TILE`×`TILE` px averaged to one grey level keeps that: a black fill, a missing title or
//! axis title, or a clipped label changes a tile by far more than a font's metrics do.

mod common;
mod report_runs;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{ferry_output, stderr};
use report_runs::{postcopy, stats, write};

/// The side of a tile, in px: about one 13 px label's line high, so that a missing word
/// takes a good part of its tile's ink, while a glyph drawn a pixel off moves little of it.
const TILE: u32 = 16;
/// How far (in grey levels of 255) one tile may differ between two renderers. Measured on
/// this report (Debian 12: librsvg 2.54, ImageMagick 6.9.11, Chromium, DejaVu fonts): fonts
/// and anti-aliasing move a tile by 19 at most; a missing 13 px word (an axis's unit or
/// title) moves its tiles by 30 to 50, a missing run title by 64, a black fill or a blank
/// picture by up to 255. 25 parts the two.
const TILE_TOLERANCE: u8 = 25;
/// How many tiles may differ by more: none, since one missing word shows in one tile or two.
const TILES_ALLOWED: usize = 0;

/// A renderer: its name, the command that must exist and the Debian package that brings it.
struct Renderer {
    name: &'static str,
    command: &'static str,
    package: &'static str,
}

const RSVG: Renderer = Renderer {
    name: "librsvg",
    command: "rsvg-convert",
    package: "librsvg2-bin",
};
/// ImageMagick's own `convert`, by its path: a `convert` earlier on `PATH` may be another.
const MAGICK: Renderer = Renderer {
    name: "ImageMagick (MSVG)",
    command: "/usr/bin/convert",
    package: "imagemagick",
};
const CHROMIUM: Renderer = Renderer {
    name: "Chromium",
    command: "chromium",
    package: "chromium",
};

/// Runs `renderer` with `args`, failing the test with the package to install when it is
/// missing, and with its output when it fails.
fn run(renderer: &Renderer, args: &[&str]) -> Vec<u8> {
    let out = Command::new(renderer.command)
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "{} ({}) cannot be run: {e}; install it (Debian: apt-get install {}, or \
                 scripts/test-setup as root)",
                renderer.name, renderer.command, renderer.package
            )
        });
    assert!(
        out.status.success(),
        "{} {args:?} failed: {}",
        renderer.command,
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// Fails the test unless ImageMagick has its own SVG renderer: Debian ships it (the `svg`
/// coder) in a package `imagemagick` only recommends, and without it `msvg:` hands the file
/// to `rsvg-convert` and fails.
fn require_msvg() {
    let formats = String::from_utf8_lossy(&run(&MAGICK, &["-list", "format"])).into_owned();
    assert!(
        formats.lines().any(|l| l.trim_start().starts_with("MSVG")),
        "ImageMagick has no SVG renderer of its own (MSVG); install it (Debian: apt-get \
         install {MSVG_PACKAGE}, or scripts/test-setup as root)"
    );
}

/// The Debian package holding ImageMagick's `svg` coder, MSVG with it.
const MSVG_PACKAGE: &str = "libmagickcore-6.q16-6-extra";

/// The picture's size in px, from the SVG's own `width` and `height`.
fn size(svg: &str) -> (u32, u32) {
    let attribute = |name: &str| -> u32 {
        let at = svg.find(&format!(" {name}=\"")).expect(name) + name.len() + 3;
        let rest = &svg[at..];
        rest[..rest.find('"').unwrap()].parse().expect(name)
    };
    (attribute("width"), attribute("height"))
}

/// Rasterizes `svg` with each renderer to a PNG of `width`×`height` on white, in `dir`.
fn rasterize(svg: &Path, (width, height): (u32, u32), dir: &Path) -> Vec<(&'static str, PathBuf)> {
    let (w, h) = (width.to_string(), height.to_string());
    let rsvg = dir.join("rsvg.png");
    run(
        &RSVG,
        &[
            "-w",
            &w,
            "-h",
            &h,
            "-b",
            "white",
            "-o",
            rsvg.to_str().unwrap(),
            svg.to_str().unwrap(),
        ],
    );
    let magick = dir.join("magick.png");
    run(
        &MAGICK,
        &[
            "-background",
            "white",
            &format!("msvg:{}", svg.display()),
            "-flatten",
            magick.to_str().unwrap(),
        ],
    );
    // The SVG as a page shows it: an <img> at its own size, nothing around it.
    let page = dir.join("page.html");
    std::fs::write(
        &page,
        format!(
            "<!DOCTYPE html><html><body style=\"margin:0;background:#fff\">\
             <img src=\"{}\" width=\"{width}\" height=\"{height}\" style=\"display:block\">\
             </body></html>",
            svg.file_name().unwrap().to_str().unwrap()
        ),
    )
    .unwrap();
    let chromium = dir.join("chromium.png");
    run(
        &CHROMIUM,
        &[
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--force-device-scale-factor=1",
            &format!("--user-data-dir={}", dir.join("profile").display()),
            &format!("--window-size={width},{height}"),
            &format!("--screenshot={}", chromium.display()),
            &format!("file://{}", page.display()),
        ],
    );
    vec![
        (RSVG.name, rsvg),
        (MAGICK.name, magick),
        (CHROMIUM.name, chromium),
    ]
}

/// The picture as its tiles' mean grey levels, row by row, as ImageMagick averages them.
fn tiles(png: &Path, (width, height): (u32, u32)) -> Vec<u8> {
    let (cols, rows) = (width / TILE, height / TILE);
    let grey = run(
        &MAGICK,
        &[
            png.to_str().unwrap(),
            "-background",
            "white",
            "-flatten",
            "-crop",
            &format!("{width}x{height}+0+0"),
            "+repage",
            "-colorspace",
            "gray",
            "-filter",
            "box",
            "-resize",
            &format!("{cols}x{rows}!"),
            "-depth",
            "8",
            "gray:-",
        ],
    );
    assert_eq!(
        grey.len(),
        (cols * rows) as usize,
        "{}: not {cols}×{rows} tiles",
        png.display()
    );
    grey
}

#[test]
fn a_report_renders_the_same_through_librsvg_imagemagick_and_chromium() {
    let dir = tempfile::tempdir().unwrap();
    let a = write(dir.path(), "precopy-converged.json", &stats(3, 50));
    let b = write(dir.path(), "postcopy-after-pass-2.json", &postcopy(2, 80));
    let svg_path = dir.path().join("report.svg");
    let out = ferry_output(&["report", &a, &b, "-o", svg_path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let svg = std::fs::read_to_string(&svg_path).unwrap();
    let size = size(&svg);
    require_msvg();
    let pictures = rasterize(&svg_path, size, dir.path());
    let cols = (size.0 / TILE) as usize;
    let grey: Vec<Vec<u8>> = pictures.iter().map(|(_, png)| tiles(png, size)).collect();
    let mut failures = Vec::new();
    for i in 0..pictures.len() {
        for j in i + 1..pictures.len() {
            let off: Vec<(usize, usize, u8, u8)> = grey[i]
                .iter()
                .zip(&grey[j])
                .enumerate()
                .filter(|(_, (a, b))| a.abs_diff(**b) > TILE_TOLERANCE)
                .map(|(k, (a, b))| (k % cols * TILE as usize, k / cols * TILE as usize, *a, *b))
                .collect();
            let worst = grey[i]
                .iter()
                .zip(&grey[j])
                .map(|(a, b)| a.abs_diff(*b))
                .max()
                .unwrap_or(0);
            eprintln!(
                "{} vs {}: {} tiles differ by more than {TILE_TOLERANCE}, the most by {worst}",
                pictures[i].0,
                pictures[j].0,
                off.len()
            );
            if off.len() > TILES_ALLOWED {
                failures.push(format!(
                    "{} vs {}: {} tiles of {TILE} px differ by more than {TILE_TOLERANCE} grey \
                     levels (at most {TILES_ALLOWED} may); the first at (x, y, grey, grey): {:?}",
                    pictures[i].0,
                    pictures[j].0,
                    off.len(),
                    &off[..off.len().min(12)]
                ));
            }
        }
    }
    if !failures.is_empty() {
        let kept = dir.keep();
        panic!(
            "the report renders differently (the SVG and the PNGs are kept in {}):\n{}",
            kept.display(),
            failures.join("\n")
        );
    }
}
