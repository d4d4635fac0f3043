//! Markdown tables and the machine header shared by every suite.

use crate::Common;

/// Prints the machine (cores, kernel) and date so a pasted run is self-describing.
pub(crate) fn machine_header(c: &Common) {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let cmd: Vec<String> = std::env::args().collect();
    println!("# weir-bench");
    println!();
    println!(
        "machine: {cores} cores, kernel {}; quick: {}; command: `{}`",
        kernel.trim(),
        c.quick,
        cmd.join(" ")
    );
}

/// A markdown table built row by row.
#[allow(dead_code)] // used by the suites as they land
#[derive(Debug, Default)]
pub(crate) struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

#[allow(dead_code)]
impl Table {
    pub(crate) fn new<S: Into<String>>(header: impl IntoIterator<Item = S>) -> Self {
        Self {
            header: header.into_iter().map(Into::into).collect(),
            rows: Vec::new(),
        }
    }

    pub(crate) fn row<S: Into<String>>(&mut self, cells: impl IntoIterator<Item = S>) {
        self.rows.push(cells.into_iter().map(Into::into).collect());
    }

    pub(crate) fn print(&self) {
        println!("| {} |", self.header.join(" | "));
        println!("|{}", "---|".repeat(self.header.len()));
        for r in &self.rows {
            println!("| {} |", r.join(" | "));
        }
        println!();
    }
}

#[allow(dead_code)] // used by the suites as they land
/// `a / b` formatted as a ratio, or "-" when `b` is zero or not finite.
pub(crate) fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 && b.is_finite() {
        format!("{:.2}x", a / b)
    } else {
        "-".into()
    }
}

#[cfg(test)]
mod tests {
    use super::ratio;

    #[test]
    fn a_ratio_needs_a_reference() {
        assert_eq!(ratio(118.0, 175.0), "0.67x");
        assert_eq!(ratio(118.0, f64::INFINITY), "-", "no peer measured");
        assert_eq!(ratio(118.0, 0.0), "-");
        assert_eq!(ratio(118.0, f64::NAN), "-");
    }
}
