//! One module per `kvplug` command: its clap arguments and what it prints.

pub mod bench;
pub mod chat;
pub mod conform;
pub mod demo;
pub mod model;
pub mod plan;
pub mod plugins;
pub mod run;
pub mod serve;
pub mod session;
