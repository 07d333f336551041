//! Live progress for `ferry migrate` and `ferry demo`: an indicatif bar when stdout is a
//! terminal, else the plain lines of [`super::progress_line`] (for logs and pipes).

use std::io::IsTerminal;
use std::time::Duration;

use ferry_migrate::{Phase, Progress};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How the plain lines are printed when stdout is not a terminal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlainLines {
    /// One line to stderr per update (`ferry migrate`: a log of every poll).
    EveryUpdateToStderr,
    /// One indented line to stdout per precopy pass (`ferry demo`: a short story).
    PerPassToStdout,
}

/// The spinner turns every 100 ms: smooth to the eye, and far cheaper than the migration.
const TICK: Duration = Duration::from_millis(100);

/// Shows progress as it arrives.
#[derive(Debug)]
pub struct Live {
    bar: Option<ProgressBar>,
    plain: PlainLines,
    last_pass: u32,
}

impl Live {
    pub fn new(plain: PlainLines) -> Live {
        let bar = std::io::stdout().is_terminal().then(|| {
            let bar = ProgressBar::with_draw_target(Some(1), ProgressDrawTarget::stdout());
            bar.set_style(
                ProgressStyle::with_template(
                    "{spinner:.green} {prefix:<10.bold} [{bar:24.cyan/blue}] {msg}",
                )
                .expect("the template is valid")
                .progress_chars("=> "),
            );
            bar.enable_steady_tick(TICK);
            bar
        });
        Live {
            bar,
            plain,
            last_pass: u32::MAX,
        }
    }

    pub fn update(&mut self, p: &Progress) {
        let Some(bar) = &self.bar else {
            match self.plain {
                PlainLines::EveryUpdateToStderr => eprintln!("{}", super::progress_line(p)),
                PlainLines::PerPassToStdout => {
                    if p.pass != self.last_pass && p.pass > 0 && p.phase == Phase::Precopy {
                        println!("  {}", super::progress_line(p));
                        self.last_pass = p.pass;
                    }
                }
            }
            return;
        };
        bar.set_prefix(super::text::phase_name(p.phase));
        // The bar fills with what was sent against what was sent plus what is known to remain
        // (in pass 1, the populated memory not walked yet); once completed, nothing remains.
        let remaining = if p.phase == Phase::Completed {
            0
        } else {
            p.remaining_bytes
        };
        if remaining == 0 && p.phase == Phase::Setup {
            bar.unset_length();
        } else {
            bar.set_length((p.bytes_sent + remaining).max(1));
        }
        bar.set_position(p.bytes_sent);
        bar.set_message(super::text::progress_figures(p));
    }

    /// Leaves the bar's last state on screen.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }
}
