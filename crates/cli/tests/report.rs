//! `ferry report` end to end on synthetic statistics: the picture has its charts and series,
//! several runs are drawn side by side, and bad requests exit with status 2.

mod common;
mod report_runs;

use common::{ferry_output, stderr};
use report_runs::{stats, write};

fn report(args: &[&str]) -> std::process::Output {
    let mut all = vec!["report"];
    all.extend_from_slice(args);
    ferry_output(&all)
}

#[test]
fn ferry_report_draws_the_timeline_downtime_and_passes_of_a_run() {
    let dir = tempfile::tempdir().unwrap();
    let input = write(dir.path(), "run-one.json", &stats(3, 50));
    let out_path = dir.path().join("run.svg");
    let out = report(&[&input, "-o", out_path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let svg = std::fs::read_to_string(&out_path).unwrap();
    assert!(svg.starts_with("<svg"), "{}", &svg[..100.min(svg.len())]);
    for want in [
        "run-one",
        "Timeline",
        "sent MB",
        "dirty remaining MB",
        "send MB/s",
        "dirty MB/s",
        "switchover",
        "Downtime 40.0 ms",
        "pause 2.0 ms",
        "final pages 12.0 ms",
        "transfer 20.0 ms",
        "save: 2 vCPUs 0.40 ms (slowest vcpu 0 0.300 ms), vm clock 0.050 ms",
        "load: 1 vCPUs 2.00 ms (slowest vcpu 0 2.000 ms), serial port 0 1.500 ms",
        "Passes",
        "duration ms",
        "final",
        "time (s)",
    ] {
        assert!(svg.contains(want), "the SVG lacks '{want}'");
    }
    assert!(svg.contains("<polyline"), "the timeline's series are drawn");
    assert!(
        !svg.contains("Postcopy fault to page"),
        "no latencies, no histogram"
    );
}

#[test]
fn ferry_report_draws_several_runs_side_by_side_and_as_html() {
    let dir = tempfile::tempdir().unwrap();
    let a = write(dir.path(), "fast.json", &stats(2, 80));
    // A run as `ferry bench` prints it: the statistics under "stats".
    let b_path = dir.path().join("slow.json");
    let row = serde_json::json!({"bench": "precopy", "stats": stats(6, 30)});
    std::fs::write(&b_path, row.to_string()).unwrap();
    let b = b_path.to_str().unwrap();
    let svg_path = dir.path().join("cmp.svg");
    let out = report(&[&a, b, "-o", svg_path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let svg = std::fs::read_to_string(&svg_path).unwrap();
    assert!(
        svg.contains("fast") && svg.contains("slow"),
        "both runs named"
    );
    assert_eq!(svg.matches(">\nTimeline\n<").count(), 2, "a timeline each");
    assert_eq!(svg.matches(">\nPasses\n<").count(), 2, "pass bars each");
    let one_column = report(&[&a, "-o", dir.path().join("one.svg").to_str().unwrap()]);
    assert!(one_column.status.success());
    let width = |svg: &str| -> u32 {
        let w = svg.split("width=\"").nth(1).unwrap();
        w[..w.find('"').unwrap()].parse().unwrap()
    };
    let one = std::fs::read_to_string(dir.path().join("one.svg")).unwrap();
    assert_eq!(width(&svg), 2 * width(&one), "two columns");

    let html_path = dir.path().join("cmp.html");
    let out = report(&[&a, b, "-o", html_path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let html = std::fs::read_to_string(&html_path).unwrap();
    assert!(html.starts_with("<!DOCTYPE html>"));
    assert!(html.contains("<title>ferry report: fast vs slow</title>"));
    assert!(html.contains("<svg") && html.contains("Timeline"));
}

#[test]
fn bad_report_and_migrate_requests_exit_with_status_2() {
    let dir = tempfile::tempdir().unwrap();
    let input = write(dir.path(), "run.json", &stats(1, 10));
    let socket = dir.path().join("no.sock");
    let socket = socket.to_str().unwrap();
    let table: [(Vec<&str>, &str); 5] = [
        (
            vec!["report", &input, "-o", "out.png"],
            "write to a .svg or .html file",
        ),
        (vec!["report", "-o", "out.svg"], "required"),
        (
            vec!["migrate", "--api-socket", socket, "--to", "udp:127.0.0.1:1"],
            "write tcp:HOST:PORT",
        ),
        (
            vec![
                "migrate",
                "--api-socket",
                socket,
                "--to",
                "tcp:127.0.0.1:1",
                "--channels",
                "0",
            ],
            "--channels 0: use 1 to 64",
        ),
        (
            vec![
                "migrate",
                "--api-socket",
                socket,
                "--to",
                "tcp:127.0.0.1:1",
                "--packet-size",
                "6K",
            ],
            "a multiple of 4K",
        ),
    ];
    for (args, want) in table {
        let out = ferry_output(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(want), "{args:?}: {}", stderr(&out));
    }
    // A file that is not statistics is a failure (1), with the fix.
    let junk = dir.path().join("junk.json");
    std::fs::write(&junk, "{\"hello\": 1}").unwrap();
    let out = ferry_output(&["report", junk.to_str().unwrap(), "-o", "x.svg"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("--stats-out"), "{}", stderr(&out));
}
