//! The result table: one row per figure, rendered as aligned text and as Markdown, and
//! the number formats the rows use.

use std::time::Duration;

/// Whether a row met its target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    Fail,
    /// No target: reported for context.
    Info,
    /// The scenario could not run.
    Error,
}

impl Verdict {
    fn as_str(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Fail => "FAIL",
            Verdict::Info => "info",
            Verdict::Error => "ERROR",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Row {
    pub figure: String,
    pub value: String,
    pub baseline: String,
    pub ratio: String,
    pub target: String,
    pub verdict: Verdict,
}

fn ratio_text(r: f64) -> String {
    if !r.is_finite() {
        "–".into()
    } else if r >= 100.0 {
        format!("{r:.0}×")
    } else if r >= 10.0 {
        format!("{r:.1}×")
    } else {
        format!("{r:.2}×")
    }
}

fn verdict(ok: bool) -> Verdict {
    if ok {
        Verdict::Pass
    } else {
        Verdict::Fail
    }
}

impl Row {
    /// `value / baseline` must be at least `min`.
    pub fn ratio_at_least(
        figure: impl Into<String>,
        (value, value_text): (f64, String),
        (baseline, baseline_text): (f64, String),
        min: f64,
    ) -> Row {
        let r = value / baseline;
        Row {
            figure: figure.into(),
            value: value_text,
            baseline: baseline_text,
            ratio: ratio_text(r),
            target: format!("ratio ≥ {min}"),
            verdict: verdict(r.is_finite() && r >= min),
        }
    }

    /// `value / baseline` must be at most `max`.
    pub fn ratio_at_most(
        figure: impl Into<String>,
        (value, value_text): (f64, String),
        (baseline, baseline_text): (f64, String),
        max: f64,
    ) -> Row {
        let r = value / baseline;
        Row {
            figure: figure.into(),
            value: value_text,
            baseline: baseline_text,
            ratio: ratio_text(r),
            target: format!("ratio ≤ {max}"),
            verdict: verdict(r.is_finite() && r <= max),
        }
    }

    /// An absolute target: `ok` says whether `value` met `target`.
    pub fn absolute(
        figure: impl Into<String>,
        value: String,
        target: impl Into<String>,
        ok: bool,
    ) -> Row {
        Row {
            figure: figure.into(),
            value,
            baseline: "–".into(),
            ratio: "–".into(),
            target: target.into(),
            verdict: verdict(ok),
        }
    }

    /// A figure without a target.
    pub fn info(figure: impl Into<String>, value: String) -> Row {
        Row {
            figure: figure.into(),
            value,
            baseline: "–".into(),
            ratio: "–".into(),
            target: "–".into(),
            verdict: Verdict::Info,
        }
    }

    /// A figure without a target, next to a baseline.
    pub fn info_vs(
        figure: impl Into<String>,
        (value, value_text): (f64, String),
        (baseline, baseline_text): (f64, String),
    ) -> Row {
        Row {
            figure: figure.into(),
            value: value_text,
            baseline: baseline_text,
            ratio: ratio_text(value / baseline),
            target: "–".into(),
            verdict: Verdict::Info,
        }
    }

    /// A scenario that failed to run.
    pub fn error(scenario: &str, message: &str) -> Row {
        let message = message.replace('\n', " ").replace('|', "/");
        let message = if message.chars().count() > 300 {
            let cut: String = message.chars().take(300).collect();
            format!("{cut}…")
        } else {
            message
        };
        Row {
            figure: format!("{scenario}: could not run"),
            value: message,
            baseline: "–".into(),
            ratio: "–".into(),
            target: "–".into(),
            verdict: Verdict::Error,
        }
    }

    /// The cells, with `|` escaped so the row stays one Markdown row.
    fn cells(&self) -> [String; 6] {
        [
            &self.figure,
            &self.value,
            &self.baseline,
            &self.ratio,
            &self.target,
            self.verdict.as_str(),
        ]
        .map(|c| c.replace('|', "\\|"))
    }
}

const HEAD: [&str; 6] = [
    "figure",
    "value",
    "baseline",
    "ratio",
    "target",
    "pass/fail",
];

/// The widest line [`Report::text`] prints.
pub const TEXT_WIDTH: usize = 100;

/// The text table's column widths, two spaces between columns: 88 + 5 × 2 = 98.
const COLUMNS: [usize; 6] = [22, 19, 19, 7, 12, 9];

/// `text` in lines of at most `width` characters, broken at spaces where it can be.
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = Vec::new();
    let mut line = String::new();
    for word in text.split(' ') {
        let mut word = word.to_string();
        loop {
            let room = if line.is_empty() {
                width
            } else {
                width.saturating_sub(line.chars().count() + 1)
            };
            let len = word.chars().count();
            if len <= room {
                if !line.is_empty() {
                    line.push(' ');
                }
                line.push_str(&word);
                break;
            }
            if line.is_empty() {
                // A word wider than the column: cut it.
                let head: String = word.chars().take(width).collect();
                word = word.chars().skip(width).collect();
                lines.push(head);
            } else {
                lines.push(std::mem::take(&mut line));
            }
        }
    }
    if !line.is_empty() || lines.is_empty() {
        lines.push(line);
    }
    lines
}

/// The rows of a run, with lines describing it.
pub struct Report {
    pub header: Vec<String>,
    pub rows: Vec<Row>,
    /// Some scenario could not run.
    pub failed: bool,
}

impl Report {
    pub fn new(header: Vec<String>) -> Report {
        Report {
            header,
            rows: Vec::new(),
            failed: false,
        }
    }

    /// Aligned text for a terminal, at most [`TEXT_WIDTH`] columns a line: a cell longer
    /// than its column wraps onto the next lines of its row.
    pub fn text(&self) -> String {
        let mut out = String::new();
        for h in &self.header {
            for line in wrap(h, TEXT_WIDTH) {
                out.push_str(&line);
                out.push('\n');
            }
        }
        out.push('\n');
        let row = |cells: [&str; 6], out: &mut String| {
            let wrapped: Vec<Vec<String>> = cells
                .iter()
                .zip(COLUMNS)
                .map(|(cell, w)| wrap(cell, w))
                .collect();
            let height = wrapped.iter().map(Vec::len).max().unwrap_or(1);
            for i in 0..height {
                let mut line = String::new();
                for (lines, w) in wrapped.iter().zip(COLUMNS) {
                    let cell = lines.get(i).map(String::as_str).unwrap_or("");
                    line.push_str(cell);
                    line.push_str(&" ".repeat(w - cell.chars().count() + 2));
                }
                out.push_str(line.trim_end());
                out.push('\n');
            }
        };
        row(HEAD, &mut out);
        for r in &self.rows {
            row(
                [
                    &r.figure,
                    &r.value,
                    &r.baseline,
                    &r.ratio,
                    &r.target,
                    r.verdict.as_str(),
                ],
                &mut out,
            );
        }
        let (pass, fail) = self.counts();
        out.push_str(&format!("\n{pass} targets met, {fail} missed\n"));
        out
    }

    /// Markdown, for a file or the README.
    pub fn markdown(&self) -> String {
        let mut out = String::new();
        for h in &self.header {
            out.push_str(h);
            out.push_str("  \n");
        }
        out.push('\n');
        out.push_str(&format!("| {} |\n", HEAD.join(" | ")));
        out.push_str("|---|---:|---:|---:|---|---|\n");
        for row in &self.rows {
            out.push_str(&format!("| {} |\n", row.cells().join(" | ")));
        }
        let (pass, fail) = self.counts();
        out.push_str(&format!("\n{pass} targets met, {fail} missed.\n"));
        out
    }

    fn counts(&self) -> (usize, usize) {
        let pass = self
            .rows
            .iter()
            .filter(|r| r.verdict == Verdict::Pass)
            .count();
        let fail = self
            .rows
            .iter()
            .filter(|r| matches!(r.verdict, Verdict::Fail | Verdict::Error))
            .count();
        (pass, fail)
    }
}

/// `12,345` style.
pub fn thousands(n: f64) -> String {
    let n = n.round() as i64;
    let digits = n.unsigned_abs().to_string();
    let groups: Vec<&str> = digits
        .as_bytes()
        .rchunks(3)
        .rev()
        .map(|g| std::str::from_utf8(g).unwrap_or("?"))
        .collect();
    let out = groups.join(",");
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}

/// A rate with its unit, as `(number, text)`.
pub fn per_sec(rate: f64, unit: &str) -> (f64, String) {
    (rate, format!("{} {unit}/s", thousands(rate)))
}

/// A duration in a readable unit, as `(seconds, text)`.
pub fn dur(d: Duration) -> (f64, String) {
    let s = d.as_secs_f64();
    let text = if s < 1e-3 {
        format!("{:.1} µs", s * 1e6)
    } else if s < 1.0 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    };
    (s, text)
}

/// KiB as MiB text.
pub fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

/// The `q`-quantile (0..=1) of sorted samples.
pub fn quantile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// The median of numbers.
pub fn median_f64(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The median of samples (sorted here).
pub fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    quantile(&samples, 0.5)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_table_fits_a_terminal_and_keeps_every_word() {
        let mut report = Report::new(vec![format!("sizes: {}", "a long header ".repeat(20))]);
        report.rows.push(Row {
            figure: "subscribe notifications".into(),
            value: "32 notifications/s (100 notifications carrying 1,000,000 of the 1,000,000 \
                    operation changes, over 3.17 s)"
                .into(),
            baseline: "agent 30.6 + snapshotter 33.2 ms CPU per 1,000 calls (52 % of 2 cores)"
                .into(),
            ratio: "0.001×".into(),
            target: "≤ 16,715 (half of 33,429 at the start)".into(),
            verdict: Verdict::Pass,
        });
        report.rows.push(Row::error("finalize", &"x".repeat(250)));
        let text = report.text();
        for line in text.lines() {
            assert!(line.chars().count() <= TEXT_WIDTH, "{line:?}");
        }
        let words = |s: &str| s.split_whitespace().map(str::to_string).collect::<Vec<_>>();
        for word in words("1,000,000 operation changes, over 3.17 s) (52 % of 2 cores) 33,429") {
            assert!(text.contains(&word), "{word} is lost");
        }
        assert_eq!(text.matches('x').count(), 250);
    }
}
