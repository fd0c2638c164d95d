//! The KV cache's element types (`-ctk`, `-ctv`): what both the model (to size a cache) and the
//! session (to create one) name, so it lives below both.

use crate::error::{Error, Result};

/// The element type of the KV cache's K or V (`-ctk` / `-ctv`, llama.cpp's names). Quantized
/// types halve (`q8_0`) or quarter (`q4_0`) the cache; a quantized V needs flash attention, as in
/// llama.cpp.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub enum CacheType {
    F32,
    #[default]
    F16,
    Bf16,
    Q8_0,
    Q4_0,
    Q4_1,
    Iq4Nl,
    Q5_0,
    Q5_1,
}

impl CacheType {
    /// Every type llama.cpp offers for the KV cache, in its order.
    pub const ALL: [CacheType; 9] = [
        CacheType::F32,
        CacheType::F16,
        CacheType::Bf16,
        CacheType::Q8_0,
        CacheType::Q4_0,
        CacheType::Q4_1,
        CacheType::Iq4Nl,
        CacheType::Q5_0,
        CacheType::Q5_1,
    ];

    /// llama.cpp's name (`ggml_type_name`).
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            CacheType::F32 => "f32",
            CacheType::F16 => "f16",
            CacheType::Bf16 => "bf16",
            CacheType::Q8_0 => "q8_0",
            CacheType::Q4_0 => "q4_0",
            CacheType::Q4_1 => "q4_1",
            CacheType::Iq4Nl => "iq4_nl",
            CacheType::Q5_0 => "q5_0",
            CacheType::Q5_1 => "q5_1",
        }
    }

    /// Block-quantized (everything but f32, f16, bf16).
    #[must_use]
    pub fn is_quantized(self) -> bool {
        !matches!(self, CacheType::F32 | CacheType::F16 | CacheType::Bf16)
    }

    pub(crate) fn to_sys(self) -> crate::sys::ggml_type {
        use crate::sys;
        match self {
            CacheType::F32 => sys::GGML_TYPE_F32,
            CacheType::F16 => sys::GGML_TYPE_F16,
            CacheType::Bf16 => sys::GGML_TYPE_BF16,
            CacheType::Q8_0 => sys::GGML_TYPE_Q8_0,
            CacheType::Q4_0 => sys::GGML_TYPE_Q4_0,
            CacheType::Q4_1 => sys::GGML_TYPE_Q4_1,
            CacheType::Iq4Nl => sys::GGML_TYPE_IQ4_NL,
            CacheType::Q5_0 => sys::GGML_TYPE_Q5_0,
            CacheType::Q5_1 => sys::GGML_TYPE_Q5_1,
        }
    }
}

impl std::fmt::Display for CacheType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for CacheType {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        CacheType::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = CacheType::ALL.iter().map(|t| t.name()).collect();
                Error::InvalidConfig(format!(
                    "unknown KV cache type {s:?}: use one of {}",
                    names.join(", ")
                ))
            })
    }
}
