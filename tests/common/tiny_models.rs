//! Tiny random-weight GGUFs of real architectures, one builder per architecture: the tensors
//! (names and shapes) and the hparams that the pinned llama.cpp's `load_arch_hparams` /
//! `load_arch_tensors` (`src/models/<arch>.cpp`) require for that kind of model, at a tiny size
//! (n_embd 64 or 128, 2 to 6 layers, head_dim 32 or 64). The tokenizer is the default model's
//! (all of its `tokenizer.*` keys), so the vocabulary is 49,152 tokens and every model reads the
//! same prompt.
//!
//! Weights: 2-D and 3-D matrices F16 from N(0, 0.02), norms F32 1.0, biases and other vectors
//! F32 from N(0, 0.02) unless said otherwise, all from one seeded generator per tensor
//! ([`gguf::Rng::for_tensor`]), so a model is the same file every time.
//!
//! `general.name` is neutral on purpose: llama.cpp picks token attributes by model name, and a
//! name containing "phi3" made it look up a `</s>` token that this tokenizer does not have.

use std::sync::OnceLock;

use super::gguf::{Rng, TensorType, Value, Writer};

/// What a builder makes: the GGUF to write and one line on what it holds.
pub struct TinyModel {
    pub gguf: Writer,
    pub describe: String,
}

/// The default model's `tokenizer.*` keys, read once per test binary.
pub fn tokenizer() -> &'static [(String, Value)] {
    static KV: OnceLock<Vec<(String, Value)>> = OnceLock::new();
    KV.get_or_init(|| {
        let path = super::model_path();
        let kv: Vec<_> = super::gguf::read_metadata(&path)
            .unwrap_or_else(|e| panic!("cannot read the metadata of {}: {e}", path.display()))
            .into_iter()
            .filter(|(k, _)| k.starts_with("tokenizer."))
            .collect();
        assert!(
            kv.iter().any(|(k, _)| k == "tokenizer.ggml.tokens"),
            "{} has no tokenizer.ggml.tokens",
            path.display()
        );
        kv
    })
}

const SEED: u64 = 0x7e57_a4c4;
const STD: f32 = 0.02;

/// A GGUF under construction for one architecture, with the helpers every builder uses.
struct Build {
    w: Writer,
    arch: &'static str,
    n_vocab: usize,
}

impl Build {
    /// The file's general keys and tokenizer, and the hparams every model has.
    fn new(arch: &'static str, h: &Common) -> Build {
        let mut w = Writer::new(arch);
        w.set("general.type", "model");
        w.set(
            "general.name",
            "tiny random-weight model for the architecture matrix",
        );
        w.set("general.file_type", 1u32); // MOSTLY_F16
        w.set("general.quantization_version", 2u32);
        let mut n_vocab = 0;
        for (k, v) in tokenizer() {
            if k == "tokenizer.ggml.tokens" {
                n_vocab = v.len().unwrap();
            }
            w.set(k, v.clone());
        }
        let mut b = Build { w, arch, n_vocab };
        b.kv("vocab_size", n_vocab as u32);
        b.kv("context_length", h.n_ctx);
        b.kv("embedding_length", h.n_embd as u32);
        b.kv("block_count", h.n_layer as u32);
        b.kv("feed_forward_length", h.n_ff as u32);
        b.kv("attention.head_count", h.n_head as u32);
        b.kv("attention.head_count_kv", h.n_head_kv as u32);
        b.kv("attention.layer_norm_rms_epsilon", h.eps);
        b.kv("rope.freq_base", h.rope_base);
        if h.head_dim * h.n_head != h.n_embd {
            // head_dim differs from n_embd / n_head: the converters write it
            b.kv("attention.key_length", h.head_dim as u32);
            b.kv("attention.value_length", h.head_dim as u32);
        }
        b.kv("rope.dimension_count", h.head_dim as u32);
        b
    }

    /// Sets `<arch>.<suffix>`.
    fn kv(&mut self, suffix: &str, v: impl Into<Value>) {
        let key = format!("{}.{suffix}", self.arch);
        self.w.set(&key, v);
    }

    /// A weight matrix (F16, N(0, 0.02)); `ne` as llama.cpp's `create_tensor` writes it.
    fn mat(&mut self, name: &str, ne: &[usize]) {
        let n = ne.iter().product();
        let v = Rng::for_tensor(SEED, name).normal(n, STD);
        self.w.tensor(name, ne, TensorType::F16, v);
    }

    /// A norm weight: F32 ones.
    fn ones(&mut self, name: &str, n: usize) {
        self.w.tensor(name, &[n], TensorType::F32, vec![1.0; n]);
    }

    /// An F32 tensor of N(0, std²) values (biases, sinks).
    fn vec(&mut self, name: &str, ne: &[usize], std: f32) {
        let n = ne.iter().product();
        let v = Rng::for_tensor(SEED, name).normal(n, std);
        self.w.tensor(name, ne, TensorType::F32, v);
    }

    /// `token_embd` and `output_norm`, and `output` unless the embeddings are tied.
    fn embeddings(&mut self, n_embd: usize, tied: bool) {
        let n_vocab = self.n_vocab;
        self.mat("token_embd.weight", &[n_embd, n_vocab]);
        self.ones("output_norm.weight", n_embd);
        if !tied {
            self.mat("output.weight", &[n_embd, n_vocab]);
        }
    }

    /// Separate q/k/v projections (optionally with biases) and the output projection.
    fn attention(&mut self, il: usize, h: &Common, bias: bool) {
        let (q, kv) = (h.n_head * h.head_dim, h.n_head_kv * h.head_dim);
        let b = format!("blk.{il}");
        self.mat(&format!("{b}.attn_q.weight"), &[h.n_embd, q]);
        self.mat(&format!("{b}.attn_k.weight"), &[h.n_embd, kv]);
        self.mat(&format!("{b}.attn_v.weight"), &[h.n_embd, kv]);
        if bias {
            self.vec(&format!("{b}.attn_q.bias"), &[q], STD);
            self.vec(&format!("{b}.attn_k.bias"), &[kv], STD);
            self.vec(&format!("{b}.attn_v.bias"), &[kv], STD);
        }
        self.mat(&format!("{b}.attn_output.weight"), &[q, h.n_embd]);
    }

    /// A SwiGLU feed-forward block (gate, up, down).
    fn swiglu(&mut self, il: usize, n_embd: usize, n_ff: usize) {
        let b = format!("blk.{il}");
        self.mat(&format!("{b}.ffn_gate.weight"), &[n_embd, n_ff]);
        self.mat(&format!("{b}.ffn_up.weight"), &[n_embd, n_ff]);
        self.mat(&format!("{b}.ffn_down.weight"), &[n_ff, n_embd]);
    }

    /// A pre-norm llama-style layer: attn_norm, attention, ffn_norm, SwiGLU.
    fn llama_layer(&mut self, il: usize, h: &Common, qkv_bias: bool) {
        self.ones(&format!("blk.{il}.attn_norm.weight"), h.n_embd);
        self.attention(il, h, qkv_bias);
        self.ones(&format!("blk.{il}.ffn_norm.weight"), h.n_embd);
        self.swiglu(il, h.n_embd, h.n_ff);
    }

    fn done(self, describe: String) -> TinyModel {
        TinyModel {
            gguf: self.w,
            describe,
        }
    }
}

/// The hparams every builder sets.
struct Common {
    n_ctx: u32,
    n_embd: usize,
    n_layer: usize,
    n_ff: usize,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    eps: f32,
    rope_base: f32,
}

impl Common {
    fn shape(&self) -> String {
        format!(
            "n_embd {}, {} layers, {} heads / {} KV heads of {}, n_ff {}",
            self.n_embd, self.n_layer, self.n_head, self.n_head_kv, self.head_dim, self.n_ff
        )
    }
}

const fn common(n_embd: usize, n_layer: usize, n_head: usize, n_head_kv: usize) -> Common {
    Common {
        n_ctx: 4096,
        n_embd,
        n_layer,
        n_ff: 2 * n_embd,
        n_head,
        n_head_kv,
        head_dim: 32,
        eps: 1e-5,
        rope_base: 10_000.0,
    }
}

/// Llama 3.1's kind: GQA (4 query heads share 2 KV heads), untied output, `rope_freqs` (the
/// Llama 3 long-context frequency factors), rope base 500,000.
pub fn llama_gqa() -> TinyModel {
    let h = Common {
        rope_base: 500_000.0,
        ..common(128, 2, 4, 2)
    };
    let mut b = Build::new("llama", &h);
    b.embeddings(h.n_embd, false);
    // factors >= 1 that divide the low frequencies, as llama 3's rope scaling writes them
    let n = h.head_dim / 2;
    let factors = (0..n)
        .map(|i| 1.0 + 7.0 * i as f32 / (n - 1) as f32)
        .collect();
    b.w.tensor("rope_freqs.weight", &[n], TensorType::F32, factors);
    for il in 0..h.n_layer {
        b.llama_layer(il, &h, false);
    }
    let d = format!(
        "{}; GQA; untied output; rope_freqs; rope base 5e5",
        h.shape()
    );
    b.done(d)
}

/// Llama 2's kind: multi-head attention (as many KV heads as query heads), untied output.
pub fn llama_mha() -> TinyModel {
    let h = common(128, 2, 4, 4);
    let mut b = Build::new("llama", &h);
    b.embeddings(h.n_embd, false);
    for il in 0..h.n_layer {
        b.llama_layer(il, &h, false);
    }
    b.done(format!("{}; MHA; untied output", h.shape()))
}

/// Qwen2.5's kind: q/k/v biases, GQA, tied embeddings, rope base 1e6.
pub fn qwen2() -> TinyModel {
    let h = Common {
        rope_base: 1e6,
        eps: 1e-6,
        ..common(128, 2, 4, 2)
    };
    let mut b = Build::new("qwen2", &h);
    b.embeddings(h.n_embd, true);
    for il in 0..h.n_layer {
        b.llama_layer(il, &h, true);
    }
    b.done(format!("{}; q/k/v biases; tied embeddings", h.shape()))
}

/// Qwen3's kind: per-head RMS norms of q and k (`attn_q_norm`, `attn_k_norm`), a head_dim
/// larger than n_embd / n_head (q is wider than the residual stream), tied embeddings.
pub fn qwen3() -> TinyModel {
    let h = Common {
        head_dim: 64,
        rope_base: 1e6,
        eps: 1e-6,
        ..common(128, 2, 4, 2)
    };
    let mut b = Build::new("qwen3", &h);
    b.embeddings(h.n_embd, true);
    for il in 0..h.n_layer {
        b.llama_layer(il, &h, false);
        b.ones(&format!("blk.{il}.attn_q_norm.weight"), h.head_dim);
        b.ones(&format!("blk.{il}.attn_k_norm.weight"), h.head_dim);
    }
    b.done(format!(
        "{}; q/k norms; head_dim 64 > n_embd/n_head; tied",
        h.shape()
    ))
}

/// Phi-3's kind: fused `attn_qkv` and fused gate+up (`ffn_up` is 2 × n_ff wide), MHA, a
/// `sliding_window` key (2047, which llama.cpp turns off for Phi-3), untied output.
pub fn phi3() -> TinyModel {
    let h = common(128, 2, 4, 4);
    let mut b = Build::new("phi3", &h);
    b.kv("attention.sliding_window", 2047u32);
    b.embeddings(h.n_embd, false);
    for il in 0..h.n_layer {
        let p = format!("blk.{il}");
        b.ones(&format!("{p}.attn_norm.weight"), h.n_embd);
        b.mat(&format!("{p}.attn_qkv.weight"), &[h.n_embd, 3 * h.n_embd]);
        b.mat(&format!("{p}.attn_output.weight"), &[h.n_embd, h.n_embd]);
        b.ones(&format!("{p}.ffn_norm.weight"), h.n_embd);
        b.mat(&format!("{p}.ffn_up.weight"), &[h.n_embd, 2 * h.n_ff]);
        b.mat(&format!("{p}.ffn_down.weight"), &[h.n_ff, h.n_embd]);
    }
    b.done(format!(
        "{}; fused qkv and gate+up; sliding_window 2047 (ignored by llama.cpp)",
        h.shape()
    ))
}

/// A Gemma 2 or 3 layer: pre- and post-norms around attention and the feed-forward block.
fn gemma_layer(b: &mut Build, il: usize, h: &Common, qk_norm: bool) {
    let p = format!("blk.{il}");
    b.ones(&format!("{p}.attn_norm.weight"), h.n_embd);
    b.attention(il, h, false);
    if qk_norm {
        b.ones(&format!("{p}.attn_q_norm.weight"), h.head_dim);
        b.ones(&format!("{p}.attn_k_norm.weight"), h.head_dim);
    }
    b.ones(&format!("{p}.post_attention_norm.weight"), h.n_embd);
    b.ones(&format!("{p}.ffn_norm.weight"), h.n_embd);
    b.swiglu(il, h.n_embd, h.n_ff);
    b.ones(&format!("{p}.post_ffw_norm.weight"), h.n_embd);
}

/// Gemma 2's kind: attention logit soft-capping (50) and final logit soft-capping (30),
/// alternating sliding-window (512 here; 4096 in Gemma 2) and global layers, post-norms, q wider
/// than n_embd, tied embeddings. Three layers, so that a window layer follows the global one.
pub fn gemma2() -> TinyModel {
    let h = Common {
        eps: 1e-6,
        ..common(64, 3, 4, 2)
    };
    let mut b = Build::new("gemma2", &h);
    b.kv("attn_logit_softcapping", 50.0f32);
    b.kv("final_logit_softcapping", 30.0f32);
    b.kv("attention.sliding_window", 512u32);
    b.embeddings(h.n_embd, true);
    for il in 0..h.n_layer {
        gemma_layer(&mut b, il, &h, false);
    }
    b.done(format!(
        "{}; attn soft-cap 50, final soft-cap 30; window 512 on layers 0, 2; post-norms; tied",
        h.shape()
    ))
}

/// Gemma 3's kind: five sliding-window layers (window 512, as Gemma 3 270M) to one global
/// layer, their own rope bases (1e4 local, 1e6 global), q/k norms, post-norms, MQA (one KV
/// head), tied embeddings. Seven layers, so that a window layer follows the global one.
pub fn gemma3() -> TinyModel {
    let h = Common {
        eps: 1e-6,
        rope_base: 1e6,
        ..common(64, 7, 4, 1)
    };
    let mut b = Build::new("gemma3", &h);
    b.kv("attention.sliding_window", 512u32);
    b.kv("rope.freq_base_swa", 10_000.0f32);
    b.embeddings(h.n_embd, true);
    for il in 0..h.n_layer {
        gemma_layer(&mut b, il, &h, true);
    }
    b.done(format!(
        "{}; window 512 on layers 0-4 and 6, layer 5 global; q/k norms; post-norms; tied",
        h.shape()
    ))
}

/// Ministral 3's kind (`mistral3`): YaRN rope scaling (factor 4 from 1024 positions, beta
/// 32/1) and llama-4-style attention temperature scaling (0.1) past the original context, q
/// wider than n_embd, tied embeddings.
pub fn mistral3() -> TinyModel {
    let h = Common {
        rope_base: 1e6,
        ..common(64, 2, 4, 2)
    };
    let mut b = Build::new("mistral3", &h);
    b.kv("rope.scaling.type", "yarn");
    b.kv("rope.scaling.factor", 4.0f32);
    b.kv("rope.scaling.original_context_length", 1024u32);
    b.kv("rope.scaling.yarn_beta_fast", 32.0f32);
    b.kv("rope.scaling.yarn_beta_slow", 1.0f32);
    b.kv("rope.scaling.yarn_log_multiplier", 1.0f32);
    b.kv("attention.temperature_scale", 0.1f32);
    b.embeddings(h.n_embd, true);
    for il in 0..h.n_layer {
        b.llama_layer(il, &h, false);
    }
    b.done(format!(
        "{}; YaRN x4 from 1024; attention temperature 0.1; tied",
        h.shape()
    ))
}

/// Granite 3's kind: its four scales (embedding 12, residual 0.22, attention 1/128, logits
/// 1/8), GQA, tied embeddings.
pub fn granite() -> TinyModel {
    let h = common(128, 2, 4, 2);
    let mut b = Build::new("granite", &h);
    b.kv("embedding_scale", 12.0f32);
    b.kv("residual_scale", 0.22f32);
    b.kv("attention.scale", 0.007_812_5f32);
    b.kv("logit_scale", 8.0f32);
    b.embeddings(h.n_embd, true);
    for il in 0..h.n_layer {
        b.llama_layer(il, &h, false);
    }
    b.done(format!(
        "{}; embedding 12 / residual 0.22 / attention 1/128 / logit 8 scales; tied",
        h.shape()
    ))
}

fn olmo2_build(h: &Common, window: Option<u32>) -> Build {
    let mut b = Build::new("olmo2", h);
    if let Some(w) = window {
        b.kv("attention.sliding_window", w);
    }
    b.embeddings(h.n_embd, false);
    for il in 0..h.n_layer {
        // OLMo 2 normalises after attention and after the FFN, never before; q and k are
        // RMS-normed over all heads at once
        let p = format!("blk.{il}");
        b.attention(il, h, false);
        b.ones(&format!("{p}.attn_q_norm.weight"), h.n_head * h.head_dim);
        b.ones(&format!("{p}.attn_k_norm.weight"), h.n_head_kv * h.head_dim);
        b.ones(&format!("{p}.post_attention_norm.weight"), h.n_embd);
        b.swiglu(il, h.n_embd, h.n_ff);
        b.ones(&format!("{p}.post_ffw_norm.weight"), h.n_embd);
    }
    b
}

/// OLMo 2's kind: post-norms only, q/k norms over all heads, MHA, untied output.
pub fn olmo2() -> TinyModel {
    let h = Common {
        eps: 1e-6,
        rope_base: 500_000.0,
        ..common(128, 2, 4, 4)
    };
    let b = olmo2_build(&h, None);
    b.done(format!(
        "{}; post-norms only; q/k norms over all heads; untied",
        h.shape()
    ))
}

/// Olmo 3's kind (`olmo2` with `sliding_window`): three sliding-window layers (256 here; 4096
/// in Olmo 3) to one global layer, otherwise OLMo 2. Five layers, so that a window layer
/// follows the global one.
pub fn olmo2_swa() -> TinyModel {
    let h = Common {
        eps: 1e-6,
        rope_base: 500_000.0,
        ..common(128, 5, 4, 4)
    };
    let b = olmo2_build(&h, Some(256));
    b.done(format!(
        "{}; window 256 on layers 0-2 and 4, layer 3 global; post-norms only",
        h.shape()
    ))
}

/// gpt-oss's kind (`gpt-oss`): learned attention sinks (one logit per head), a mixture of 4
/// experts (2 used) with biases everywhere (router, experts, q/k/v, output), sliding-window
/// (128) and global layers alternating, YaRN (x4 from 1024), attention and post-attention
/// norms, untied output. Three layers, so that a window layer follows the global one.
pub fn gpt_oss() -> TinyModel {
    let h = Common {
        rope_base: 150_000.0,
        ..common(64, 3, 4, 1)
    };
    let (n_expert, n_ff_exp) = (4, 64);
    let mut b = Build::new("gpt-oss", &h);
    b.kv("expert_count", n_expert as u32);
    b.kv("expert_used_count", 2u32);
    b.kv("expert_feed_forward_length", n_ff_exp as u32);
    b.kv("attention.sliding_window", 128u32);
    b.kv("rope.scaling.type", "yarn");
    b.kv("rope.scaling.factor", 4.0f32);
    b.kv("rope.scaling.original_context_length", 1024u32);
    b.embeddings(h.n_embd, false);
    for il in 0..h.n_layer {
        let p = format!("blk.{il}");
        b.ones(&format!("{p}.attn_norm.weight"), h.n_embd);
        b.attention(il, &h, true);
        b.vec(&format!("{p}.attn_output.bias"), &[h.n_embd], STD);
        // large enough that a sink takes a visible share of a query's attention, so that the
        // reference proof (tests/h2o_reference.rs) tells sinks from none
        b.vec(&format!("{p}.attn_sinks.weight"), &[h.n_head], 4.0);
        b.ones(&format!("{p}.post_attention_norm.weight"), h.n_embd);
        b.mat(&format!("{p}.ffn_gate_inp.weight"), &[h.n_embd, n_expert]);
        b.vec(&format!("{p}.ffn_gate_inp.bias"), &[n_expert], STD);
        for (name, ne, bias) in [
            ("gate", [h.n_embd, n_ff_exp, n_expert], [n_ff_exp, n_expert]),
            ("up", [h.n_embd, n_ff_exp, n_expert], [n_ff_exp, n_expert]),
            ("down", [n_ff_exp, h.n_embd, n_expert], [h.n_embd, n_expert]),
        ] {
            b.mat(&format!("{p}.ffn_{name}_exps.weight"), &ne);
            b.vec(&format!("{p}.ffn_{name}_exps.bias"), &bias, STD);
        }
    }
    b.done(format!(
        "{}; attention sinks; MoE 4 experts (2 used) with biases; window 128 on layers 0, 2; YaRN",
        h.shape()
    ))
}

/// The DeepSeek-V2/V3 layout at a tiny size: low-rank q (q_lora_rank 48) and compressed KV
/// (kv_lora_rank 32) with a decoupled rope part (16 dims), one leading dense layer, then MoE
/// layers with a shared expert. `mla` chooses how the KV up-projection is stored:
/// - true (DeepSeek-V3 and GGUFs converted since MLA support): `attn_k_b` / `attn_v_b` per head,
///   the cache holds the compressed latent (one "KV head" of kv_lora_rank + rope dims);
///   V3's sigmoid gating with `exp_probs_b`, expert groups (2, 1 used), weights normalised and
///   scaled by 2.5;
/// - false (DeepSeek-V2 GGUFs from before MLA): one `attn_kv_b`, the cache holds full per-head
///   K (nope + rope = 64 dims) and V (32 dims); V2's softmax gating.
fn deepseek2_build(mla: bool) -> TinyModel {
    let (n_embd, n_layer, n_head) = (64, 2, 4);
    let (q_lora, kv_lora, rope, nope, v_head) = (48, 32, 16, 48, 32);
    let (n_ff, n_expert, n_ff_exp) = (128, 4, 32);
    let k_head = nope + rope;
    let h = Common {
        n_ff,
        n_head_kv: if mla { 1 } else { n_head },
        head_dim: rope,
        ..common(n_embd, n_layer, n_head, n_head)
    };
    let mut b = Build::new("deepseek2", &h);
    // Build::new wrote the rope dims; the head sizes are the layout's own
    if mla {
        b.kv("attention.key_length", (kv_lora + rope) as u32);
        b.kv("attention.value_length", kv_lora as u32);
        b.kv("attention.key_length_mla", k_head as u32);
        b.kv("attention.value_length_mla", v_head as u32);
    } else {
        b.kv("attention.key_length", k_head as u32);
        b.kv("attention.value_length", v_head as u32);
    }
    b.kv("attention.q_lora_rank", q_lora as u32);
    b.kv("attention.kv_lora_rank", kv_lora as u32);
    b.kv("leading_dense_block_count", 1u32);
    b.kv("expert_count", n_expert as u32);
    b.kv("expert_used_count", 2u32);
    b.kv("expert_shared_count", 1u32);
    b.kv("expert_feed_forward_length", n_ff_exp as u32);
    if mla {
        b.kv("expert_weights_scale", 2.5f32);
        b.kv("expert_weights_norm", true);
        b.kv("expert_gating_func", 2u32); // sigmoid
        b.kv("expert_group_count", 2u32);
        b.kv("expert_group_used_count", 1u32);
    } else {
        b.kv("expert_weights_scale", 1.0f32);
        b.kv("expert_gating_func", 1u32); // softmax
    }
    b.kv("rope.scaling.type", "yarn");
    b.kv("rope.scaling.factor", 4.0f32);
    b.kv("rope.scaling.original_context_length", 1024u32);
    b.kv("rope.scaling.yarn_log_multiplier", 0.1f32);
    b.embeddings(n_embd, false);
    for il in 0..n_layer {
        let p = format!("blk.{il}");
        b.ones(&format!("{p}.attn_norm.weight"), n_embd);
        b.ones(&format!("{p}.attn_q_a_norm.weight"), q_lora);
        b.ones(&format!("{p}.attn_kv_a_norm.weight"), kv_lora);
        b.mat(&format!("{p}.attn_q_a.weight"), &[n_embd, q_lora]);
        b.mat(&format!("{p}.attn_q_b.weight"), &[q_lora, n_head * k_head]);
        b.mat(
            &format!("{p}.attn_kv_a_mqa.weight"),
            &[n_embd, kv_lora + rope],
        );
        if mla {
            b.mat(&format!("{p}.attn_k_b.weight"), &[nope, kv_lora, n_head]);
            b.mat(&format!("{p}.attn_v_b.weight"), &[kv_lora, v_head, n_head]);
        } else {
            b.mat(
                &format!("{p}.attn_kv_b.weight"),
                &[kv_lora, n_head * (nope + v_head)],
            );
        }
        b.mat(
            &format!("{p}.attn_output.weight"),
            &[n_head * v_head, n_embd],
        );
        b.ones(&format!("{p}.ffn_norm.weight"), n_embd);
        if il == 0 {
            b.swiglu(il, n_embd, n_ff);
            continue;
        }
        b.mat(&format!("{p}.ffn_gate_inp.weight"), &[n_embd, n_expert]);
        if mla {
            b.vec(&format!("{p}.exp_probs_b.bias"), &[n_expert], STD);
        }
        b.mat(
            &format!("{p}.ffn_gate_exps.weight"),
            &[n_embd, n_ff_exp, n_expert],
        );
        b.mat(
            &format!("{p}.ffn_up_exps.weight"),
            &[n_embd, n_ff_exp, n_expert],
        );
        b.mat(
            &format!("{p}.ffn_down_exps.weight"),
            &[n_ff_exp, n_embd, n_expert],
        );
        b.mat(&format!("{p}.ffn_gate_shexp.weight"), &[n_embd, n_ff_exp]);
        b.mat(&format!("{p}.ffn_up_shexp.weight"), &[n_embd, n_ff_exp]);
        b.mat(&format!("{p}.ffn_down_shexp.weight"), &[n_ff_exp, n_embd]);
    }
    let layout = if mla {
        "MLA: attn_k_b/attn_v_b, cache = latent 32 + rope 16 (1 KV head); sigmoid gating, 2 expert groups"
    } else {
        "no MLA: attn_kv_b, cache = per-head K 64 / V 32; softmax gating"
    };
    b.done(format!(
        "n_embd 64, 2 layers (1 dense + 1 MoE: 4 experts, 2 used, 1 shared), 4 heads; \
         q_lora 48, kv_lora 32, rope 16; {layout}; YaRN"
    ))
}

/// DeepSeek-V3's kind in the MLA layout (see [`deepseek2_build`]).
pub fn deepseek2_mla() -> TinyModel {
    deepseek2_build(true)
}

/// DeepSeek-V2's kind in the old layout without MLA (see [`deepseek2_build`]).
pub fn deepseek2() -> TinyModel {
    deepseek2_build(false)
}
