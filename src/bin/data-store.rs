//! `data-store`: the fenced resource. `POST /write` accepts a write only with a current fencing
//! token; every accepted write is flushed to a text file before the answer.

use std::process::ExitCode;

fn main() -> ExitCode {
    raftlock::datastore::cli::data_store_main(std::env::args_os())
}
