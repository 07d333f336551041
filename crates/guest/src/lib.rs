//! The pure parts of ferry's built-in test guest: which page the next write goes to, how many
//! writes the rate allows, the rate it reports, where in RAM the working set lives, which disk
//! block the disk workload touches next, what the network workload answers to a frame, and
//! what it makes of the VM generation ID. The kernel binary (`main.rs`, built only with the
//! `kernel` feature) runs these at CPL3; here they build and test on the host like any code.

#![no_std]
#![forbid(unsafe_code)]

pub mod clockgap;
pub mod disk;
pub mod echo;
pub mod pace;
pub mod pattern;
pub mod plan;
pub mod pool;
pub mod rate;
pub mod vmgenid;
