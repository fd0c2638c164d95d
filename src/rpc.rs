//! Layers on other machines: llama.cpp's RPC backend, as `--rpc HOST:PORT,...` uses it, and the
//! server side that h2o-rpc-server runs.
//!
//! A client lists its servers in [`ModelParams::rpc_servers`](crate::ModelParams); loading the
//! model checks each one first (it answers, it speaks this build's protocol) so that a wrong
//! address or a stock llama.cpp rpc-server is refused with an error naming it, before llama.cpp's
//! RPC client, which aborts the process on any failure, connects. Every offloaded layer
//! (`n_gpu_layers`) then lives on the servers' devices, weights, KV cache and H2O state alike,
//! split in proportion to their free memory as llama.cpp does.
//!
//! The protocol: a patched build's op table has the two H2O ops after upstream's, so its RPC
//! protocol is a version of its own ([`PROTOCOL`]); a stock peer and a patched one refuse each
//! other at the handshake.

use std::ffi::{c_char, CStr, CString};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::{backend, sys};

/// The RPC protocol this build speaks (major, minor, patch): llama.cpp's, 100 above its major
/// version in a patched build.
pub const PROTOCOL: (u8, u8, u8) = (
    sys::RPC_PROTO_MAJOR_VERSION as u8,
    sys::RPC_PROTO_MINOR_VERSION as u8,
    sys::RPC_PROTO_PATCH_VERSION as u8,
);

/// How long a server may take to accept the connection and answer the handshake. A server
/// serves one client at a time, so one that is busy with another client answers only after it.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The handshake's command number and the size of its request (the transport's capabilities,
/// zero: plain TCP), as ggml-rpc.cpp defines them.
const RPC_CMD_HELLO: u8 = 14;
const CONN_CAPS_SIZE: usize = 24;

/// The servers the process has told llama.cpp about, for the message of the abort hook.
static CONNECTED: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Splits `--rpc`'s value, `HOST:PORT[,HOST:PORT...]`, checking each part's shape.
///
/// # Errors
/// [`Error::Rpc`] naming the part that is not `HOST:PORT` with a port from 1 to 65535.
pub fn parse_servers(list: &str) -> Result<Vec<String>> {
    let servers: Vec<String> = list.split(',').map(|s| s.trim().to_string()).collect();
    for s in &servers {
        let port = s.rsplit_once(':').and_then(|(host, port)| {
            (!host.is_empty())
                .then(|| port.parse::<u16>().ok())
                .flatten()
        });
        if !matches!(port, Some(p) if p > 0) {
            return Err(Error::Rpc {
                server: s.clone(),
                reason: "not HOST:PORT: give --rpc HOST:PORT[,HOST:PORT...] (e.g. \
                         --rpc 192.168.1.10:50052,192.168.1.11:50052)"
                    .into(),
            });
        }
    }
    Ok(servers)
}

/// Checks that `server` answers and speaks [`PROTOCOL`]: connects, sends the handshake that
/// llama.cpp's RPC client sends, and reads the version the server answers.
///
/// # Errors
/// [`Error::Rpc`] naming the server: unreachable, closed the connection, silent for
/// [`HANDSHAKE_TIMEOUT`], or of another protocol (a stock llama.cpp rpc-server, or another
/// build's).
pub fn check_server(server: &str) -> Result<()> {
    let fail = |reason: String| Error::Rpc {
        server: server.to_string(),
        reason,
    };
    let addrs: Vec<_> = server
        .to_socket_addrs()
        .map_err(|e| fail(format!("cannot resolve it: {e}")))?
        .collect();
    let mut last = None;
    let mut stream = None;
    for addr in &addrs {
        match TcpStream::connect_timeout(addr, HANDSHAKE_TIMEOUT) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = Some(e),
        }
    }
    let mut stream = stream.ok_or_else(|| {
        fail(format!(
            "cannot connect: {} (is h2o-rpc-server running there, on that port?)",
            last.map_or_else(|| "no address".to_string(), |e| e.to_string())
        ))
    })?;
    let io = |e: std::io::Error| {
        if matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ) {
            fail(format!(
                "it accepted the connection but did not answer the handshake in {} s: an RPC \
                 server serves one client at a time, and this one may be serving another",
                HANDSHAKE_TIMEOUT.as_secs()
            ))
        } else {
            fail(format!(
                "the handshake failed ({e}): it is not an RPC server of protocol {}.{}.{} \
                 (run h2o-rpc-server of this build there)",
                PROTOCOL.0, PROTOCOL.1, PROTOCOL.2
            ))
        }
    };
    stream
        .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT)))
        .map_err(io)?;
    let mut request = vec![RPC_CMD_HELLO];
    request.extend_from_slice(&(CONN_CAPS_SIZE as u64).to_le_bytes());
    request.extend_from_slice(&[0u8; CONN_CAPS_SIZE]);
    stream.write_all(&request).map_err(io)?;
    let mut size = [0u8; 8];
    stream.read_exact(&mut size).map_err(io)?;
    let size = u64::from_le_bytes(size);
    if !(3..=4096).contains(&size) {
        return Err(fail(format!(
            "its answer to the handshake has {size} bytes: it is not an RPC server of protocol \
             {}.{}.{} (run h2o-rpc-server of this build there)",
            PROTOCOL.0, PROTOCOL.1, PROTOCOL.2
        )));
    }
    let mut answer = vec![0u8; size as usize];
    stream.read_exact(&mut answer).map_err(io)?;
    let (major, minor, patch) = (answer[0], answer[1], answer[2]);
    // llama.cpp's client takes a server of its major version and a minor version up to its own
    if major != PROTOCOL.0 || minor > PROTOCOL.1 {
        let (theirs, ours) = (u16::from(major), u16::from(PROTOCOL.0));
        let what = if theirs + 100 == ours {
            "a stock llama.cpp rpc-server, whose op table has no H2O ops"
        } else if theirs == ours + 100 {
            "an h2o-llama build's server, whose op table has the H2O ops this stock build lacks"
        } else {
            "a server of another llama.cpp version"
        };
        return Err(fail(format!(
            "it speaks RPC protocol {major}.{minor}.{patch}, this build {}.{}.{}: it is {what}; \
             run this build's h2o-rpc-server there",
            PROTOCOL.0, PROTOCOL.1, PROTOCOL.2
        )));
    }
    Ok(())
}

/// The error of a model or context that could not be created, from llama.cpp's `reason`: where
/// the buffer it could not allocate is an RPC server's (named `RPC<device>[HOST:PORT]` by
/// ggml-rpc), [`Error::Rpc`] naming that server, else `otherwise(reason)`.
pub(crate) fn allocation_error(reason: String, otherwise: impl FnOnce(String) -> Error) -> Error {
    let server = reason
        .find("failed to allocate RPC")
        .map(|at| &reason[at..])
        .and_then(|s| s.split_once('[')?.1.split_once(']'))
        .map(|(server, _)| server);
    match server {
        Some(server) => Error::Rpc {
            server: server.to_string(),
            reason: format!(
                "it has not enough memory for the layers or the KV cache placed on it: {reason} \
                 (a smaller -c, fewer layers on it with -ngl, or more servers)"
            ),
        },
        None => otherwise(reason),
    }
}

/// The devices of `servers` in llama.cpp's registry, each server checked first
/// ([`check_server`]), then llama.cpp's RPC client connected to it.
pub(crate) fn devices(servers: &[String]) -> Result<Vec<sys::ggml_backend_dev_t>> {
    backend::init();
    let mut devices = Vec::new();
    for server in servers {
        // a server serves one client at a time: one this process already speaks to (a model
        // loaded over it) would not answer a second connection's handshake
        let known = CONNECTED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(server);
        if !known {
            check_server(server)?;
        }
        let c_server = CString::new(server.as_str())?;
        install_abort_message(server);
        // SAFETY: a NUL-terminated endpoint that llama.cpp copies; the server answered the
        // handshake of this protocol just now, so its client's connect and handshake succeed
        // (which it would otherwise end with an abort). The registry it returns lives as long
        // as the process.
        let reg = unsafe { sys::ggml_backend_rpc_add_server(c_server.as_ptr()) };
        if reg.is_null() {
            return Err(Error::Rpc {
                server: server.clone(),
                reason: "it has no device to offer".into(),
            });
        }
        // SAFETY: a valid registry; its devices live as long as it.
        let n = unsafe { sys::ggml_backend_reg_dev_count(reg) };
        for i in 0..n {
            devices.push(unsafe { sys::ggml_backend_reg_dev_get(reg, i) });
        }
    }
    Ok(devices)
}

/// The local devices llama.cpp offloads layers to besides the RPC servers' (its default
/// selection without them): the GPUs, or the integrated GPUs where there is no other.
pub(crate) fn local_gpu_devices() -> Vec<sys::ggml_backend_dev_t> {
    backend::init();
    let (mut gpus, mut igpus) = (Vec::new(), Vec::new());
    // SAFETY: queries of the registry that backend::init set up; devices live as long as it.
    unsafe {
        for i in 0..sys::ggml_backend_dev_count() {
            let dev = sys::ggml_backend_dev_get(i);
            let reg = sys::ggml_backend_dev_backend_reg(dev);
            let is_rpc = CStr::from_ptr(sys::ggml_backend_reg_name(reg)).to_bytes() == b"RPC";
            match sys::ggml_backend_dev_type(dev) {
                sys::GGML_BACKEND_DEVICE_TYPE_GPU if !is_rpc => gpus.push(dev),
                sys::GGML_BACKEND_DEVICE_TYPE_IGPU if !is_rpc => igpus.push(dev),
                _ => {}
            }
        }
    }
    if gpus.is_empty() {
        igpus
    } else {
        gpus
    }
}

/// llama.cpp's RPC client ends the process (ggml's abort) when a server stops answering, which
/// it cannot recover from: say which servers it was speaking to, and skip the debugger-driven
/// backtrace ggml would print instead (slow, and no help here).
fn install_abort_message(server: &str) {
    let mut connected = CONNECTED.lock().unwrap_or_else(|e| e.into_inner());
    if connected.is_empty() {
        // SAFETY: a 'static function; ggml calls it once, just before abort().
        unsafe { sys::ggml_set_abort_callback(Some(abort_message)) };
    }
    if !connected.iter().any(|s| s == server) {
        connected.push(server.to_string());
    }
}

unsafe extern "C" fn abort_message(message: *const c_char) {
    let text = if message.is_null() {
        String::new()
    } else {
        // SAFETY: ggml passes a NUL-terminated message.
        unsafe { CStr::from_ptr(message) }
            .to_string_lossy()
            .into_owned()
    };
    let servers = CONNECTED
        .try_lock()
        .map(|s| s.join(","))
        .unwrap_or_default();
    eprintln!(
        "h2o-llama: llama.cpp stopped the process: {text}\n\
         h2o-llama: with layers on RPC servers ({servers}) this means one of them stopped \
         answering (ended, crashed, or the network failed); llama.cpp's RPC client cannot go on \
         without it. Start the server again and run the command again."
    );
}

/// What h2o-rpc-server serves.
#[derive(Debug, Clone)]
pub struct RpcServeConfig {
    /// Address to listen on (`--host`): 127.0.0.1 by default; 0.0.0.0 exposes the machine.
    pub host: String,
    /// Port (`--port`).
    pub port: u16,
    /// CPU threads of the CPU device (`--threads`).
    pub threads: u32,
    /// Where to keep large tensors between runs (`--cache`), so that a client loading the same
    /// model again sends their hashes instead of their bytes.
    pub cache_dir: Option<std::path::PathBuf>,
}

/// Serves this machine's devices (its GPUs, or the CPU where it has none) to RPC clients, one
/// client at a time, until the process ends. Prints llama.cpp's banner (protocol, endpoint,
/// devices) on stdout.
///
/// # Errors
/// [`Error::Rpc`] when the address cannot be listened on (in use, not this machine's) or the
/// server cannot start its devices.
pub fn serve(config: &RpcServeConfig) -> Result<std::convert::Infallible> {
    let endpoint = format!("{}:{}", config.host, config.port);
    let fail = |reason: String| Error::Rpc {
        server: endpoint.clone(),
        reason,
    };
    // llama.cpp's server says only "Failed to create server socket"; ask first, for the reason
    drop(TcpListener::bind(&endpoint).map_err(|e| fail(format!("cannot listen there: {e}")))?);
    if let Some(dir) = &config.cache_dir {
        std::fs::create_dir_all(dir)
            .map_err(|e| fail(format!("cannot create the cache {}: {e}", dir.display())))?;
    }
    backend::init();
    let mut devices = local_gpu_devices();
    if devices.is_empty() {
        // SAFETY: a registry query; the CPU device lives as long as the process.
        let cpu = unsafe { sys::ggml_backend_dev_by_type(sys::GGML_BACKEND_DEVICE_TYPE_CPU) };
        if cpu.is_null() {
            return Err(fail("this build has no CPU device".into()));
        }
        devices.push(cpu);
    }
    let c_endpoint = CString::new(endpoint.as_str())?;
    let c_cache = match &config.cache_dir {
        Some(dir) => Some(path_cstring(dir)?),
        None => None,
    };
    // SAFETY: NUL-terminated strings and a device array that outlive the call, which serves
    // until the process ends and returns only when it could not start.
    unsafe {
        sys::ggml_backend_rpc_start_server(
            c_endpoint.as_ptr(),
            c_cache.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
            config.threads.max(1) as usize,
            devices.len(),
            devices.as_mut_ptr(),
        );
    }
    Err(fail(format!(
        "llama.cpp's RPC server stopped: {}",
        backend::recent_log_reason()
    )))
}

fn path_cstring(path: &Path) -> Result<CString> {
    Ok(CString::new(path.as_os_str().as_encoded_bytes())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_rpc_buffer_that_could_not_be_allocated_names_its_server() {
        let reason = "ggml_backend_buft_alloc_buffer_n_default: failed to allocate \
                      RPC1[10.0.0.12:50052] buffer of size 1509949440; failed to allocate buffer \
                      for kv cache";
        match allocation_error(reason.to_string(), Error::InvalidConfig) {
            Error::Rpc { server, reason } => {
                assert_eq!(server, "10.0.0.12:50052");
                assert!(reason.contains("not enough memory") && reason.contains("kv cache"));
            }
            e => panic!("{e}"),
        }
        for other in [
            "failed to allocate CPU buffer of size 8",
            "failed to allocate RPC0 buffer]x[",
            "",
        ] {
            assert!(matches!(
                allocation_error(other.to_string(), Error::InvalidConfig),
                Error::InvalidConfig(r) if r == other
            ));
        }
    }

    #[test]
    fn servers_are_host_and_port() {
        assert_eq!(
            parse_servers("a:1, [::1]:50052").unwrap(),
            ["a:1", "[::1]:50052"]
        );
        for bad in ["a", "a:0", ":1", "a:b", "a:65536", "a:1,"] {
            assert!(parse_servers(bad).is_err(), "{bad}");
        }
    }
}
