//! Printing migration progress and statistics, shared by `ferry migrate` and `ferry demo`.

use ferry_migrate::stats::PostcopyTrigger;
use ferry_migrate::{MigrationStats, Progress, StatePart};
use ferry_vmm::disk_copy::DiskCopyStatus;

/// One line of live progress.
pub fn progress_line(p: &Progress) -> String {
    format!("{:<10} {}", phase_name(p.phase), progress_figures(p))
}

/// What a migration in `p.phase` is doing, in the figures that phase has: the pass being
/// sent and what it has left (pass 1: the populated memory it has not walked yet), the
/// rate and when what is left should be sent, the dirty rate and the pause the last sync
/// predicts; in postcopy, what is left and the destination's requests.
pub fn progress_figures(p: &Progress) -> String {
    use ferry_migrate::Phase;
    let mb = |bytes: u64| format!("{:.1} MB", bytes as f64 / 1e6);
    let sent = format!("sent {}", mb(p.bytes_sent));
    let rate = format!("{:.0} MB/s", p.bandwidth_mb_s);
    let eta = match p.eta_ms {
        Some(ms) => format!("eta {}", duration(ms)),
        None => "eta -".into(),
    };
    let line = match p.phase {
        Phase::Setup if p.local => "connecting, passing guest RAM's descriptor".into(),
        Phase::Setup => "connecting, opening the data channels, starting the dirty log".into(),
        Phase::Precopy => {
            let dirty = match p.pass {
                0 => "dirty -".into(),
                _ => format!("dirty {:.0} pages/s", p.dirty_rate_pages_per_s),
            };
            let of = if p.pass == 0 {
                " of populated memory"
            } else {
                ""
            };
            let state = match p.state_remaining_bytes {
                0 => String::new(),
                b => format!(" ({} of it device state)", mb(b)),
            };
            let predicted = match &p.prediction {
                Some(f) => format!("  {}", super::predicted::prediction_figures(f)),
                None => String::new(),
            };
            format!(
                "pass {}  left {}{of}{state}  {sent}  {rate}  {eta}  {dirty}  expected downtime {}{predicted}",
                p.pass + 1,
                mb(p.remaining_bytes),
                p.expected_downtime_ms
                    .map_or("-".to_string(), |d| format!("{d:.1} ms")),
            )
        }
        Phase::Discarding => format!(
            "postcopy decided after pass {}: the destination drops the {} it will fetch again  {sent}",
            p.pass,
            mb(p.remaining_bytes)
        ),
        Phase::Switchover => format!(
            "guest paused: final pages and device state  left {}  {sent}",
            mb(p.remaining_bytes)
        ),
        Phase::Postcopy | Phase::PostcopyPaused => format!(
            "guest runs on the destination  left {}  {sent}  {rate}  {eta}  requests {} ({} pages)",
            mb(p.remaining_bytes),
            p.postcopy_requests,
            p.postcopy_pages_requested
        ),
        Phase::Completed if p.local => "guest RAM handed over, no page sent".into(),
        Phase::Completed | Phase::Failed | Phase::Cancelled => sent,
    };
    line + &throttled(p.throttle_percent) + &recovered(p)
}

/// A duration for a person: "850 ms", "12.3 s", "4 min 05 s".
fn duration(ms: f64) -> String {
    match ms {
        ms if ms < 1000.0 => format!("{ms:.0} ms"),
        ms if ms < 60_000.0 => format!("{:.1} s", ms / 1000.0),
        ms => {
            let s = (ms / 1000.0).round() as u64;
            format!("{} min {:02} s", s / 60, s % 60)
        }
    }
}

/// "  recovered N×" once a postcopy migration recovered, and what broke while it is paused.
pub fn recovered(p: &Progress) -> String {
    let mut s = String::new();
    if p.recoveries > 0 {
        s += &format!("  recovered {}×", p.recoveries);
    }
    if p.phase == ferry_migrate::Phase::PostcopyPaused {
        s += &format!(
            "  ({}; waiting for ferry migrate-recover on the destination, then ferry migrate --resume here)",
            p.error.as_deref().unwrap_or("paused")
        );
    }
    s
}

/// A phase as the API spells it (`postcopy_paused`).
pub fn phase_name(phase: ferry_migrate::Phase) -> String {
    serde_json::to_value(phase)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{phase:?}"))
}

/// "  throttle N%" when the guest is throttled.
pub fn throttled(percent: u8) -> String {
    if percent == 0 {
        String::new()
    } else {
        format!("  throttle {percent}%")
    }
}

/// A save's or load's parts in a line: the vCPUs together (with the slowest), then the other
/// parts, slowest first. The whole list is in the statistics' JSON.
pub fn parts_summary(parts: &[StatePart]) -> String {
    let pieces = parts_pieces(parts);
    match pieces.is_empty() {
        true => "not timed by the VMM".into(),
        false => pieces.join(", "),
    }
}

/// The pieces of [`parts_summary`], for a report that wraps them between pieces.
pub fn parts_pieces(parts: &[StatePart]) -> Vec<String> {
    let (vcpus, others): (Vec<&StatePart>, Vec<&StatePart>) =
        parts.iter().partition(|p| p.name.starts_with("vcpu "));
    let mut out = Vec::new();
    if let Some(slowest) = vcpus.iter().max_by(|a, b| a.ms.total_cmp(&b.ms)) {
        let ms: f64 = vcpus.iter().map(|p| p.ms).sum();
        out.push(format!(
            "{} vCPUs {ms:.2} ms (slowest {} {:.3} ms)",
            vcpus.len(),
            slowest.name,
            slowest.ms
        ));
    }
    let mut others = others;
    others.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    out.extend(others.iter().map(|p| format!("{} {:.3} ms", p.name, p.ms)));
    out
}

/// Why a migration switched to postcopy, in a few words.
pub fn trigger_name(trigger: PostcopyTrigger) -> &'static str {
    match trigger {
        PostcopyTrigger::Asked => "asked for",
        PostcopyTrigger::AfterPasses => "pass count",
        PostcopyTrigger::Policy => "policy",
        PostcopyTrigger::Prediction => "prediction",
    }
}

/// What a migration that did not complete had done, in one line: no downtime, no final pass.
pub fn print_partial(s: &MigrationStats, phase: ferry_migrate::Phase) {
    let when = match s.timeline.last().map_or(s.passes.len() as u32, |x| x.pass) {
        0 => "in setup".to_string(),
        pass => format!("in pass {pass}"),
    };
    println!(
        "{} after {:.1} s, {when}: sent {:.1} MB at {:.1} MB/s",
        phase_name(phase),
        s.total_ms / 1000.0,
        s.bytes_sent as f64 / 1e6,
        s.bandwidth_mb_s
    );
}

/// A local handover's statistics for a person: its time and pause, and the state that moved;
/// no page was sent and no dirty page tracked, so a copy's figures (sent, passes, dirty
/// syncs) would all read zero.
pub fn print_local_table(s: &MigrationStats) {
    println!(
        "total            {:>10.1} ms (setup {:.1} ms: guest RAM's descriptor passed, no page copied)",
        s.total_ms, s.setup_ms
    );
    print_pause(&s.downtime);
    println!(
        "CPU              {:>10.3} s old process, {:.3} s new process",
        s.cpu_seconds_source, s.cpu_seconds_destination
    );
}

/// The pause's lines of a table: its parts, and the state that moved in it.
fn print_pause(d: &ferry_migrate::stats::Downtime) {
    println!(
        "downtime         {:>10.1} ms = {}",
        d.total_ms,
        downtime_parts(d)
    );
    if !d.save_parts.is_empty() || !d.load_parts.is_empty() {
        println!(
            "state            {:>10.1} KB; save: {}",
            d.state_bytes as f64 / 1024.0,
            parts_summary(&d.save_parts)
        );
        println!("                 load: {}", parts_summary(&d.load_parts));
    }
}

/// The statistics as a table for a person.
pub fn print_table(s: &MigrationStats) {
    println!(
        "total            {:>10.1} ms (setup {:.1} ms)",
        s.total_ms, s.setup_ms
    );
    print_pause(&s.downtime);
    println!(
        "sent             {:>10.1} MB at {:.1} MB/s: {} pages, {} zero pages, {} skipped as holes",
        s.bytes_sent as f64 / 1e6,
        s.bandwidth_mb_s,
        s.pages_normal,
        s.pages_zero,
        s.pages_skipped_holes
    );
    if s.state_chunks > 0 {
        println!(
            "iterative state  {:>10.1} MB in {} chunks while the guest ran and in the pause (a copied disk's blocks)",
            s.state_chunk_bytes as f64 / 1e6,
            s.state_chunks
        );
    }
    if s.hint_rounds > 0 {
        println!(
            "free page hints  {:>10} pages not sent: the guest hinted them free ({} round{})",
            s.pages_skipped_hinted,
            s.hint_rounds,
            if s.hint_rounds == 1 { "" } else { "s" }
        );
    }
    println!(
        "CPU              {:>10.3} s source, {:.3} s destination; longest dirty sync {:.2} ms, longest step {:.2} ms",
        s.cpu_seconds_source, s.cpu_seconds_destination, s.max_sync_ms, s.max_step_ms
    );
    if let Some(c) = &s.compression {
        println!(
            "compression      {} records compressed ({:.1} MB of pages to {:.1} MB, {:.2}x), {} sent raw; {:.3} CPU s on the source",
            c.records_compressed,
            c.bytes_in as f64 / 1e6,
            c.bytes_out as f64 / 1e6,
            c.bytes_in as f64 / (c.bytes_out as f64).max(1.0),
            c.records_raw,
            c.cpu_seconds
        );
    }
    if s.staged_bytes > 0 || s.final_pages_written_in_pause > 0 {
        println!(
            "final pass       staged in {:.1} MiB of memory; {} pages written to the file in the pause (past the staging limit)",
            s.staged_bytes as f64 / (1 << 20) as f64,
            s.final_pages_written_in_pause
        );
    }
    if s.throttle_max_percent > 0 {
        println!(
            "auto-converge    throttled the guest up to {}% while precopy stalled",
            s.throttle_max_percent
        );
    }
    if s.throttle_unsupported {
        println!("auto-converge    off: the VMM cannot throttle its vCPUs");
    }
    if s.dirty_limit_unsupported {
        println!(
            "auto-converge    throttled instead of limiting each vCPU: the VMM cannot tell which vCPU dirtied a page (start the VM with --dirty-ring)"
        );
    }
    if let Some(limit) = s.dirty_limit_min {
        println!(
            "dirty limit      each vCPU held to {:.1} MB/s at the lowest",
            limit as f64 / 1e6
        );
    }
    let precopy_s = (s.total_ms - s.downtime.total_ms).max(1.0) / 1e3;
    for v in &s.vcpus {
        println!(
            "vCPU {:<3}         dirtied {} pages ({:.1} MB/s over precopy), slept {:.0} ms for the dirty limit",
            v.vcpu,
            v.dirtied_pages,
            v.dirtied_pages as f64 * 4096.0 / 1e6 / precopy_s,
            v.limited_ms
        );
    }
    println!(
        "{:>6} {:>7} {:>10} {:>11} {:>12} {:>16} {:>9}",
        "pass", "paused", "pages", "MB", "ms", "dirty pages/s", "throttle"
    );
    for p in &s.passes {
        println!(
            "{:>6} {:>7} {:>10} {:>11.1} {:>12.1} {:>16.0} {:>8}%",
            p.pass,
            if p.paused { "yes" } else { "no" },
            p.pages,
            p.bytes as f64 / 1e6,
            p.duration_ms,
            p.dirty_rate_pages_per_s,
            p.throttle_percent
        );
    }
    super::predicted::print_predicted(s);
    if let Some(pc) = &s.postcopy {
        println!(
            "postcopy         {:>10.1} ms after pass {} ({}): {} pages discarded, {} sent on request ({} requests), {} in the background, {:.1} MB",
            pc.duration_ms,
            pc.after_passes,
            trigger_name(pc.trigger),
            pc.discarded_pages,
            pc.pages_requested,
            pc.requests,
            pc.pages_background,
            pc.bytes as f64 / 1e6
        );
        println!(
            "fault to page    {:>10.0} µs mean, p50 {} µs, p99 {} µs, max {} µs (on the destination); blocktime {:.1} ms",
            pc.latency_mean_us,
            pc.latency_p50_us,
            pc.latency_p99_us,
            pc.latency_max_us,
            pc.vcpu_blocktime_ms
        );
        if pc.recoveries > 0 {
            println!(
                "recovery         {:>10.1} ms paused in all; {} recover{} after a broken connection",
                pc.paused_ms,
                pc.recoveries,
                if pc.recoveries == 1 { "y" } else { "ies" },
            );
        }
    }
}

/// Where a downtime went: "pause P + final sync S + ... + resume R" (ms).
pub fn downtime_parts(d: &ferry_migrate::stats::Downtime) -> String {
    format!(
        "pause {:.1} + final sync {:.1} + final pages {:.1} + state save {:.1} + transfer {:.1} + load {:.1} + resume {:.1}",
        d.pause_ms,
        d.final_sync_ms,
        d.final_pages_ms,
        d.state_save_ms,
        d.transfer_ms,
        d.load_ms,
        d.resume_ms
    )
}

/// A copied disk's figures (`GET /migration`'s `disk`) in one line.
pub fn disk_copy_line(disk: &DiskCopyStatus) -> String {
    format!("disk copy: {}", disk_copy_pieces(disk).join(", "))
}

/// A copied disk's figures in pieces (`ferry report`'s title flows them): what went, its
/// dirty passes, what was left, and how long the mirror held the guest if it came on.
pub fn disk_copy_pieces(disk: &DiskCopyStatus) -> Vec<String> {
    let mb = |bytes: u64| format!("{:.1} MB", bytes as f64 / 1e6);
    let st = &disk.stats;
    let mut pieces = vec![
        format!(
            "{} of data and {} as zeros in {} chunks",
            mb(st.data_bytes),
            mb(st.zero_bytes),
            st.chunks
        ),
        format!(
            "{} dirty passes ({} blocks sent again)",
            st.dirty_passes, st.granules_again
        ),
        format!("{} left", mb(disk.pending_bytes)),
    ];
    if st.mirror {
        pieces.push(format!(
            "the mirror on, holding the guest's writes {:.0} ms",
            disk.writers_held_ms
        ));
    }
    pieces
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_disk_copy_line_names_the_mirror_only_when_it_came_on() {
        let mut disk = super::super::fixtures::disk_copy();
        disk.stats.mirror = false;
        let line = super::disk_copy_line(&disk);
        assert_eq!(
            line,
            "disk copy: 24.0 MB of data and 8.0 MB as zeros in 12 chunks, 3 dirty passes (700 blocks sent again), 0.1 MB left"
        );
        disk.stats.mirror = true;
        assert!(
            super::disk_copy_line(&disk)
                .ends_with(", the mirror on, holding the guest's writes 40 ms"),
            "{}",
            super::disk_copy_line(&disk)
        );
    }
}
