//! h2o-rpc-server: this machine's devices (its GPUs, or the CPU) for the layers of clients on
//! other machines (`h2o-cli --rpc HOST:PORT`, `h2o-server --rpc ...`), with the H2O ops: the
//! RPC server of llama.cpp (`rpc-server`), with its flags, for this build's protocol.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use h2o_llama::rpc::{self, RpcServeConfig};
use h2o_llama::SessionConfig;

/// Serves this machine's devices (its GPUs, or the CPU where it has none) to RPC clients, one
/// client at a time. Never expose it to an open network: llama.cpp's RPC protocol has no
/// authentication.
#[derive(Parser, Debug)]
#[command(name = "h2o-rpc-server", version)]
struct Cli {
    /// Address to listen on; anything other than 127.0.0.1 lets other machines in
    #[arg(short = 'H', long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on
    #[arg(short = 'p', long, default_value_t = 50052)]
    port: u16,
    /// CPU threads of the CPU device [default: all cores]
    #[arg(short = 't', long, value_name = "N")]
    threads: Option<u32>,
    /// Keep large tensors in a local cache ($LLAMA_CACHE/rpc, or ~/.cache/llama.cpp/rpc), so that
    /// a client loading the same model again sends their hashes, not their bytes
    #[arg(short = 'c', long)]
    cache: bool,
}

fn cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("LLAMA_CACHE").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(dir).join("rpc"));
    }
    let home = std::env::var_os("HOME").filter(|d| !d.is_empty())?;
    Some(PathBuf::from(home).join(".cache/llama.cpp/rpc"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if cli.host != "127.0.0.1" && cli.host != "localhost" {
        eprintln!(
            "h2o-rpc-server: warning: listening on {} lets other machines use this one's devices \
             without authentication; never do this on an open network",
            cli.host
        );
    }
    let cache_dir = if cli.cache {
        match cache_dir() {
            Some(dir) => Some(dir),
            None => {
                eprintln!("h2o-rpc-server: error: --cache needs $LLAMA_CACHE or $HOME to place it");
                return ExitCode::from(2);
            }
        }
    } else {
        None
    };
    let config = RpcServeConfig {
        host: cli.host,
        port: cli.port,
        threads: cli
            .threads
            .unwrap_or_else(|| SessionConfig::default().n_threads),
        cache_dir,
    };
    match rpc::serve(&config) {
        Ok(never) => match never {},
        Err(e) => {
            eprintln!("h2o-rpc-server: error: {e}");
            ExitCode::from(3)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn flags_are_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn flags_as_rpc_server_spells_them() {
        let c = Cli::parse_from([
            "h2o-rpc-server",
            "-H",
            "0.0.0.0",
            "-p",
            "50100",
            "-t",
            "4",
            "-c",
        ]);
        assert_eq!(
            (c.host.as_str(), c.port, c.threads, c.cache),
            ("0.0.0.0", 50100, Some(4), true)
        );
        let c = Cli::parse_from(["h2o-rpc-server"]);
        assert_eq!(
            (c.host.as_str(), c.port, c.threads, c.cache),
            ("127.0.0.1", 50052, None, false)
        );
    }
}
