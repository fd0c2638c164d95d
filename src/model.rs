//! A loaded GGUF model and its vocabulary.

use std::ffi::CString;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use crate::cache_type::CacheType;
use crate::error::{Error, Result};
use crate::{backend, rpc, sys};

/// A token id of the model's vocabulary.
pub type Token = i32;

/// A vocabulary's fill-in-the-middle tokens ([`Model::fim_tokens`]); `None` where it declares
/// none. Infill needs the first three.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FimTokens {
    pub prefix: Option<Token>,
    pub suffix: Option<Token>,
    pub middle: Option<Token>,
    /// Starts a repository's name (repo-level infill).
    pub repo: Option<Token>,
    /// Starts a file of the repository.
    pub separator: Option<Token>,
}

/// How to load a model.
#[derive(Debug, Clone, Default)]
pub struct ModelParams {
    /// Layers to offload to a GPU or the RPC servers (`-ngl`); 0 keeps everything on the CPU.
    pub n_gpu_layers: i32,
    /// RPC servers (`--rpc HOST:PORT,...`, h2o-rpc-server) whose devices take the offloaded
    /// layers, before the local GPUs, split in proportion to their free memory; each is checked
    /// (it answers, it speaks this build's protocol) before llama.cpp connects to it.
    pub rpc_servers: Vec<String>,
    /// Keep the weights in the CPU's plain buffers (`--no-repack`): no repacking into the
    /// layouts of the CPU's faster matmul kernels, as an RPC server's CPU device keeps them.
    pub no_repack: bool,
}

/// A model loaded by llama.cpp. Owns the `llama_model`; freed on drop.
#[derive(Debug)]
pub struct Model {
    ptr: NonNull<sys::llama_model>,
    path: PathBuf,
    /// No layer offloaded: `-ngl 0`, or no device to take one (no GPU, no RPC server).
    attention_on_cpu: bool,
}

// SAFETY: llama.cpp's model is immutable after loading and documented as shareable between
// contexts on different threads.
unsafe impl Send for Model {}
unsafe impl Sync for Model {}

impl Drop for Model {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from llama_model_load_from_file and is freed exactly once.
        unsafe { sys::llama_model_free(self.ptr.as_ptr()) }
    }
}

/// Checks that `path` is a readable file starting with the GGUF magic, so that the common
/// mistakes (wrong path, a directory, a safetensors or text file) get a precise message
/// before llama.cpp sees the file.
fn check_gguf_file(path: &Path) -> Result<()> {
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::ModelNotFound {
                path: path.to_path_buf(),
            })
        }
        Err(e) => {
            return Err(Error::ModelUnreadable {
                path: path.to_path_buf(),
                source: e,
            })
        }
    };
    if meta.is_dir() {
        return Err(Error::NotGguf {
            path: path.to_path_buf(),
            why: "it is a directory".into(),
        });
    }
    if meta.len() == 0 {
        return Err(Error::NotGguf {
            path: path.to_path_buf(),
            why: "the file is empty".into(),
        });
    }
    let mut magic = [0u8; 4];
    let mut file = std::fs::File::open(path).map_err(|e| Error::ModelUnreadable {
        path: path.to_path_buf(),
        source: e,
    })?;
    if meta.len() < 4 || file.read_exact(&mut magic).is_err() {
        return Err(Error::NotGguf {
            path: path.to_path_buf(),
            why: format!("only {} bytes long", meta.len()),
        });
    }
    if &magic != b"GGUF" {
        return Err(Error::NotGguf {
            path: path.to_path_buf(),
            why: format!("it starts with {magic:02x?}, not the GGUF magic"),
        });
    }
    Ok(())
}

impl Model {
    /// Loads a GGUF model.
    ///
    /// # Errors
    /// [`Error::ModelNotFound`], [`Error::ModelUnreadable`] or [`Error::NotGguf`] when the file
    /// is missing, unreadable or not GGUF; [`Error::ModelLoad`] with llama.cpp's reason when it
    /// rejects the file (truncated, unsupported architecture, ...).
    pub fn load(path: impl AsRef<Path>, params: &ModelParams) -> Result<Self> {
        let path = path.as_ref();
        check_gguf_file(path)?;
        backend::init();
        let c_path = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| {
            Error::ModelUnreadable {
                path: path.into(),
                source: std::io::Error::other("path contains NUL"),
            }
        })?;
        // SAFETY: default params are plain data; we only set scalar fields.
        let mut mp = unsafe { sys::llama_model_default_params() };
        mp.n_gpu_layers = params.n_gpu_layers;
        mp.use_extra_bufts = !params.no_repack;
        // with RPC servers, the devices llama.cpp would choose by itself were they registered:
        // the servers' first, then the local GPUs (a NULL-terminated list, copied by the load)
        let mut devices = Vec::new();
        let local_gpus = rpc::local_gpu_devices();
        let attention_on_cpu =
            params.n_gpu_layers == 0 || (params.rpc_servers.is_empty() && local_gpus.is_empty());
        if !params.rpc_servers.is_empty() {
            devices = rpc::devices(&params.rpc_servers)?;
            devices.extend(local_gpus);
            devices.push(std::ptr::null_mut());
            mp.devices = devices.as_mut_ptr();
        }
        backend::clear_recent_log();
        // SAFETY: c_path and `devices` outlive the call; the returned pointer is owned by
        // `Model`.
        let raw = unsafe { sys::llama_model_load_from_file(c_path.as_ptr(), mp) };
        drop(devices);
        let ptr = NonNull::new(raw).ok_or_else(|| {
            rpc::allocation_error(backend::recent_log_reason(), |reason| Error::ModelLoad {
                path: path.to_path_buf(),
                reason,
            })
        })?;
        Ok(Self {
            ptr,
            path: path.to_path_buf(),
            attention_on_cpu,
        })
    }

    /// Whether every layer, and so every layer's attention, runs on the CPU: nothing was
    /// offloaded (`-ngl 0`), or there was no device to offload to (no GPU, no RPC server).
    #[must_use]
    pub fn attention_on_cpu(&self) -> bool {
        self.attention_on_cpu
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::llama_model {
        self.ptr.as_ptr()
    }

    pub(crate) fn vocab(&self) -> *const sys::llama_vocab {
        // SAFETY: valid model; the vocab lives as long as the model.
        unsafe { sys::llama_model_get_vocab(self.ptr.as_ptr()) }
    }

    /// The file this model was loaded from.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Number of transformer layers.
    #[must_use]
    pub fn n_layer(&self) -> u32 {
        // SAFETY: valid model.
        unsafe { sys::llama_model_n_layer(self.ptr.as_ptr()) }.max(0) as u32
    }

    /// Number of query heads.
    #[must_use]
    pub fn n_head(&self) -> u32 {
        // SAFETY: valid model.
        unsafe { sys::llama_model_n_head(self.ptr.as_ptr()) }.max(0) as u32
    }

    /// Number of key/value heads (fewer than [`Model::n_head`] under GQA).
    #[must_use]
    pub fn n_head_kv(&self) -> u32 {
        // SAFETY: valid model.
        unsafe { sys::llama_model_n_head_kv(self.ptr.as_ptr()) }.max(0) as u32
    }

    /// The beginning-of-sequence token, if the model's tokenizer adds one.
    #[must_use]
    pub fn bos_token(&self) -> Option<Token> {
        // SAFETY: valid vocab of a valid model.
        let (adds, bos) = unsafe {
            (
                sys::llama_vocab_get_add_bos(self.vocab()),
                sys::llama_vocab_bos(self.vocab()),
            )
        };
        (adds && bos >= 0).then_some(bos)
    }

    /// The fill-in-the-middle tokens the vocabulary declares (GGUF `tokenizer.ggml.fim_*`, or
    /// found by their text when the model loads), for llama-server's `/infill`.
    #[must_use]
    pub fn fim_tokens(&self) -> FimTokens {
        let some = |t: Token| (t >= 0).then_some(t);
        // SAFETY: valid vocab of a valid model; these only read the vocabulary.
        unsafe {
            let v = self.vocab();
            FimTokens {
                prefix: some(sys::llama_vocab_fim_pre(v)),
                suffix: some(sys::llama_vocab_fim_suf(v)),
                middle: some(sys::llama_vocab_fim_mid(v)),
                repo: some(sys::llama_vocab_fim_rep(v)),
                separator: some(sys::llama_vocab_fim_sep(v)),
            }
        }
    }

    /// Embedding width.
    #[must_use]
    pub fn n_embd(&self) -> u32 {
        // SAFETY: valid model.
        unsafe { sys::llama_model_n_embd(self.ptr.as_ptr()) }.max(0) as u32
    }

    /// Bytes of a K+V cache of `n_ctx` cells in every layer with K and V of the given types
    /// (block-quantized types by their bytes per block), with the model's key and value head
    /// widths (`{arch}.attention.key_length` / `value_length` where the GGUF sets them, as
    /// Gemma 2 and gpt-oss do, else `n_embd / n_head`). Layers of a sliding window hold fewer
    /// cells in llama.cpp, so for such models this is an upper bound.
    #[must_use]
    pub fn kv_cache_bytes(&self, n_ctx: u32, k: CacheType, v: CacheType) -> u64 {
        let width = |what: &str| u64::from(self.head_width(what));
        let n_head_kv = u64::from(self.n_head_kv());
        let row = |t: CacheType, width: u64| {
            let n = i64::try_from(n_head_kv * width).unwrap_or(i64::MAX);
            // SAFETY: a pure function of a valid type and a count.
            unsafe { sys::ggml_row_size(t.to_sys(), n) as u64 }
        };
        (row(k, width("key")) + row(v, width("value")))
            * u64::from(self.n_layer())
            * u64::from(n_ctx)
    }

    /// Channels of a key head: `{arch}.attention.key_length` where the GGUF sets it (Gemma 2,
    /// Gemma 3 and gpt-oss do), else `n_embd / n_head`.
    #[must_use]
    pub fn key_head_width(&self) -> u32 {
        self.head_width("key")
    }

    /// `{arch}.attention.{what}_length` (`key` or `value`), else `n_embd / n_head`.
    fn head_width(&self, what: &str) -> u32 {
        let arch = self.meta("general.architecture").unwrap_or_default();
        self.meta(&format!("{arch}.attention.{what}_length"))
            .and_then(|s| s.parse::<u32>().ok())
            .unwrap_or_else(|| self.n_embd() / self.n_head().max(1))
    }

    /// The value of a GGUF metadata key as text, where the model has it.
    #[must_use]
    pub fn meta(&self, key: &str) -> Option<String> {
        let key = CString::new(key).ok()?;
        let mut buf = vec![0u8; 256];
        loop {
            // SAFETY: valid model, NUL-terminated key, a buffer of buf.len() bytes.
            let n = unsafe {
                sys::llama_model_meta_val_str(
                    self.ptr.as_ptr(),
                    key.as_ptr(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                )
            };
            let n = usize::try_from(n).ok()?; // -1: no such key
            if n < buf.len() {
                buf.truncate(n);
                return String::from_utf8(buf).ok();
            }
            buf.resize(n + 1, 0); // snprintf's length without the NUL: room for all of it
        }
    }

    /// Context length the model was trained with.
    #[must_use]
    pub fn n_ctx_train(&self) -> u32 {
        // SAFETY: valid model.
        unsafe { sys::llama_model_n_ctx_train(self.ptr.as_ptr()) }.max(0) as u32
    }

    /// Vocabulary size.
    #[must_use]
    pub fn n_vocab(&self) -> usize {
        // SAFETY: valid vocab.
        unsafe { sys::llama_vocab_n_tokens(self.vocab()) }.max(0) as usize
    }

    /// Size of the weights in bytes.
    #[must_use]
    pub fn size_bytes(&self) -> u64 {
        // SAFETY: valid model.
        unsafe { sys::llama_model_size(self.ptr.as_ptr()) }
    }

    /// Number of parameters.
    #[must_use]
    pub fn n_params(&self) -> u64 {
        // SAFETY: valid model.
        unsafe { sys::llama_model_n_params(self.ptr.as_ptr()) }
    }

    /// llama.cpp's one-line description (architecture, size, quantisation).
    #[must_use]
    pub fn description(&self) -> String {
        let mut buf = vec![0u8; 256];
        // SAFETY: buf is writable for its length; llama_model_desc NUL-terminates within it.
        let n =
            unsafe { sys::llama_model_desc(self.ptr.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        buf.truncate(n.clamp(0, 255) as usize);
        String::from_utf8_lossy(&buf).into_owned()
    }

    /// Whether `token` ends generation (end-of-turn, end-of-sequence).
    #[must_use]
    pub fn is_end_of_generation(&self, token: Token) -> bool {
        // SAFETY: valid vocab; any token id is accepted.
        unsafe { sys::llama_vocab_is_eog(self.vocab(), token) }
    }

    /// Tokenizes `text`. `add_special` adds BOS/EOS as the model's metadata asks;
    /// `parse_special` turns text such as `<|im_start|>` into control tokens.
    ///
    /// # Errors
    /// [`Error::NulInText`] when the text has a NUL byte; [`Error::Tokenize`] when llama.cpp fails.
    pub fn tokenize(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<Token>> {
        if let Some(pos) = text.bytes().position(|b| b == 0) {
            return Err(Error::NulInText(pos));
        }
        let len = i32::try_from(text.len())
            .map_err(|_| Error::Tokenize("text longer than 2 GiB".into()))?;
        let mut tokens: Vec<Token> = vec![0; text.len() + 2];
        for _ in 0..2 {
            // SAFETY: text is valid for `len` bytes; tokens is writable for its length.
            let n = unsafe {
                sys::llama_tokenize(
                    self.vocab(),
                    text.as_ptr().cast(),
                    len,
                    tokens.as_mut_ptr(),
                    tokens.len() as i32,
                    add_special,
                    parse_special,
                )
            };
            if n == i32::MIN {
                return Err(Error::Tokenize("too many tokens".into()));
            }
            if n >= 0 {
                tokens.truncate(n as usize);
                return Ok(tokens);
            }
            tokens.resize((-n) as usize, 0);
        }
        Err(Error::Tokenize("token count changed between calls".into()))
    }

    /// Checks that every token id is in the vocabulary, which llama.cpp assumes (it aborts on
    /// others).
    ///
    /// # Errors
    /// [`Error::InvalidToken`] naming the first id outside `0..n_vocab`.
    pub fn check_tokens(&self, tokens: &[Token]) -> Result<()> {
        let n_vocab = self.n_vocab();
        match tokens
            .iter()
            .find(|&&t| usize::try_from(t).map_or(true, |t| t >= n_vocab))
        {
            Some(&token) => Err(Error::InvalidToken { token, n_vocab }),
            None => Ok(()),
        }
    }

    /// The bytes of one token's text (may be a partial UTF-8 sequence).
    ///
    /// # Errors
    /// [`Error::InvalidToken`] when `token` is not in the vocabulary.
    pub fn token_bytes(&self, token: Token, special: bool) -> Result<Vec<u8>> {
        self.check_tokens(&[token])?;
        let mut buf = vec![0u8; 64];
        loop {
            // SAFETY: buf is writable for its length; llama.cpp writes at most that many bytes;
            // the token is in the vocabulary.
            let n = unsafe {
                sys::llama_token_to_piece(
                    self.vocab(),
                    token,
                    buf.as_mut_ptr().cast(),
                    buf.len() as i32,
                    0,
                    special,
                )
            };
            if n >= 0 {
                buf.truncate(n as usize);
                return Ok(buf);
            }
            buf.resize((-n) as usize, 0);
        }
    }

    /// Converts tokens back to text, replacing invalid UTF-8; `special` renders control tokens
    /// such as `<|im_start|>` as their text (otherwise they are left out).
    ///
    /// # Errors
    /// [`Error::InvalidToken`] when a token is not in the vocabulary.
    pub fn detokenize(&self, tokens: &[Token], special: bool) -> Result<String> {
        self.check_tokens(tokens)?;
        let n = i32::try_from(tokens.len())
            .map_err(|_| Error::Tokenize("more than 2^31 tokens to detokenize".into()))?;
        let mut buf = vec![0u8; tokens.len() * 8 + 16];
        loop {
            // SAFETY: tokens valid for its length and in the vocabulary; buf writable for its
            // length.
            let written = unsafe {
                sys::llama_detokenize(
                    self.vocab(),
                    tokens.as_ptr(),
                    n,
                    buf.as_mut_ptr().cast(),
                    i32::try_from(buf.len()).unwrap_or(i32::MAX),
                    false,
                    special,
                )
            };
            if written >= 0 {
                buf.truncate(written as usize);
                return Ok(String::from_utf8_lossy(&buf).into_owned());
            }
            buf.resize((-written) as usize, 0);
        }
    }
}
