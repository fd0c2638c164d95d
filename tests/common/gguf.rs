//! A small GGUF v3 writer and metadata reader, so that tests can make their own models: tiny
//! random-weight GGUFs of a real architecture's shape (see `tiny_models.rs`) with the default
//! model's tokenizer copied over.
//!
//! The format (ggml's `docs/gguf.md`): magic `GGUF`, version 3, tensor and key/value counts (u64),
//! the key/values (key string, u32 type, value), the tensor infos (name, dimensions ne0 first,
//! ggml type, offset into the data), then the tensor data, each tensor and the data section
//! aligned to `general.alignment` (32 unless the file says otherwise). Little-endian throughout;
//! strings are a u64 length and UTF-8 bytes without a terminator.

use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::Path;

const MAGIC: &[u8; 4] = b"GGUF";
const VERSION: u32 = 3;
/// `general.alignment` when a file does not set it; what this writer uses.
pub const ALIGNMENT: u64 = 32;

/// A metadata value type (`gguf_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Type {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    Str = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl Type {
    fn from_u32(t: u32) -> io::Result<Type> {
        Ok(match t {
            0 => Type::U8,
            1 => Type::I8,
            2 => Type::U16,
            3 => Type::I16,
            4 => Type::U32,
            5 => Type::I32,
            6 => Type::F32,
            7 => Type::Bool,
            8 => Type::Str,
            9 => Type::Array,
            10 => Type::U64,
            11 => Type::I64,
            12 => Type::F64,
            _ => return Err(bad(format!("unknown GGUF value type {t}"))),
        })
    }
}

/// A metadata value. An array carries its element type, so that an empty array keeps it.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    U64(u64),
    I64(i64),
    F64(f64),
    Array(Type, Vec<Value>),
}

impl Value {
    pub fn ty(&self) -> Type {
        match self {
            Value::U8(_) => Type::U8,
            Value::I8(_) => Type::I8,
            Value::U16(_) => Type::U16,
            Value::I16(_) => Type::I16,
            Value::U32(_) => Type::U32,
            Value::I32(_) => Type::I32,
            Value::F32(_) => Type::F32,
            Value::Bool(_) => Type::Bool,
            Value::Str(_) => Type::Str,
            Value::U64(_) => Type::U64,
            Value::I64(_) => Type::I64,
            Value::F64(_) => Type::F64,
            Value::Array(..) => Type::Array,
        }
    }

    /// An array of strings.
    pub fn strs<S: Into<String>>(items: impl IntoIterator<Item = S>) -> Value {
        Value::Array(
            Type::Str,
            items.into_iter().map(|s| Value::Str(s.into())).collect(),
        )
    }

    /// An array of u32, e.g. `llama.expert_used_count` per layer.
    pub fn u32s(items: impl IntoIterator<Item = u32>) -> Value {
        Value::Array(Type::U32, items.into_iter().map(Value::U32).collect())
    }

    /// An array of bools, e.g. `*.attention.sliding_window_pattern` per layer.
    pub fn bools(items: impl IntoIterator<Item = bool>) -> Value {
        Value::Array(Type::Bool, items.into_iter().map(Value::Bool).collect())
    }

    /// The number of elements of an array value (None for a scalar).
    pub fn len(&self) -> Option<usize> {
        match self {
            Value::Array(_, v) => Some(v.len()),
            _ => None,
        }
    }
}

impl From<u32> for Value {
    fn from(v: u32) -> Value {
        Value::U32(v)
    }
}
impl From<f32> for Value {
    fn from(v: f32) -> Value {
        Value::F32(v)
    }
}
impl From<bool> for Value {
    fn from(v: bool) -> Value {
        Value::Bool(v)
    }
}
impl From<&str> for Value {
    fn from(v: &str) -> Value {
        Value::Str(v.to_owned())
    }
}
impl From<String> for Value {
    fn from(v: String) -> Value {
        Value::Str(v)
    }
}

/// ggml tensor types this writer produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorType {
    F32 = 0,
    F16 = 1,
}

enum Data {
    F32(Vec<f32>),
    F16(Vec<u16>),
}

struct Tensor {
    name: String,
    /// ne0 first (the row length), as llama.cpp's `create_tensor` shapes are written
    ne: Vec<u64>,
    data: Data,
}

impl Tensor {
    fn ty(&self) -> TensorType {
        match self.data {
            Data::F32(_) => TensorType::F32,
            Data::F16(_) => TensorType::F16,
        }
    }

    fn n_bytes(&self) -> u64 {
        match &self.data {
            Data::F32(v) => 4 * v.len() as u64,
            Data::F16(v) => 2 * v.len() as u64,
        }
    }
}

/// Builds a GGUF v3 file in memory (metadata and tensors) and writes it out in one go.
pub struct Writer {
    kv: Vec<(String, Value)>,
    tensors: Vec<Tensor>,
}

impl Writer {
    /// A file of architecture `arch` (`general.architecture`, the prefix of the model's keys).
    pub fn new(arch: &str) -> Writer {
        Writer {
            kv: vec![("general.architecture".into(), Value::from(arch))],
            tensors: Vec::new(),
        }
    }

    /// Sets `key` (replacing an earlier value of it).
    pub fn set(&mut self, key: &str, value: impl Into<Value>) -> &mut Self {
        let value = value.into();
        match self.kv.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value,
            None => self.kv.push((key.to_owned(), value)),
        }
        self
    }

    /// Adds a tensor of shape `ne` (ne0 first) stored as `ty`.
    ///
    /// # Panics
    /// When the data does not have the shape's number of elements, or the name is taken.
    pub fn tensor(&mut self, name: &str, ne: &[usize], ty: TensorType, values: Vec<f32>) {
        let n: usize = ne.iter().product();
        assert_eq!(values.len(), n, "tensor {name}: {ne:?} needs {n} values");
        assert!(
            self.tensors.iter().all(|t| t.name != name),
            "tensor {name} added twice"
        );
        let data = match ty {
            TensorType::F32 => Data::F32(values),
            TensorType::F16 => Data::F16(values.into_iter().map(f32_to_f16).collect()),
        };
        self.tensors.push(Tensor {
            name: name.to_owned(),
            ne: ne.iter().map(|&d| d as u64).collect(),
            data,
        });
    }

    /// Names of the tensors added so far, in order.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.iter().map(|t| t.name.as_str())
    }

    /// Writes the file.
    ///
    /// # Errors
    /// What creating or writing `path` returns.
    pub fn write(&self, path: &Path) -> io::Result<()> {
        let mut w = BufWriter::with_capacity(1 << 20, File::create(path)?);
        w.write_all(MAGIC)?;
        w.write_all(&VERSION.to_le_bytes())?;
        w.write_all(&(self.tensors.len() as u64).to_le_bytes())?;
        w.write_all(&(self.kv.len() as u64).to_le_bytes())?;
        let mut pos = 4 + 4 + 8 + 8;
        for (key, value) in &self.kv {
            pos += write_str(&mut w, key)?;
            w.write_all(&(value.ty() as u32).to_le_bytes())?;
            pos += 4 + write_value(&mut w, value)?;
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            pos += write_str(&mut w, &t.name)?;
            w.write_all(&(t.ne.len() as u32).to_le_bytes())?;
            for d in &t.ne {
                w.write_all(&d.to_le_bytes())?;
            }
            w.write_all(&(t.ty() as u32).to_le_bytes())?;
            w.write_all(&offset.to_le_bytes())?;
            pos += 4 + 8 * t.ne.len() as u64 + 4 + 8;
            offset = align(offset + t.n_bytes());
        }
        pad(&mut w, align(pos) - pos)?;
        for t in &self.tensors {
            match &t.data {
                Data::F32(v) => v.iter().try_for_each(|x| w.write_all(&x.to_le_bytes()))?,
                Data::F16(v) => v.iter().try_for_each(|x| w.write_all(&x.to_le_bytes()))?,
            }
            pad(&mut w, align(t.n_bytes()) - t.n_bytes())?;
        }
        w.flush()
    }
}

fn align(n: u64) -> u64 {
    n.div_ceil(ALIGNMENT) * ALIGNMENT
}

fn pad(w: &mut impl Write, n: u64) -> io::Result<()> {
    w.write_all(&vec![0u8; n as usize])
}

/// Writes a GGUF string; returns the bytes written.
fn write_str(w: &mut impl Write, s: &str) -> io::Result<u64> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())?;
    Ok(8 + s.len() as u64)
}

/// Writes a value without its type tag; returns the bytes written.
fn write_value(w: &mut impl Write, v: &Value) -> io::Result<u64> {
    Ok(match v {
        Value::U8(x) => w.write_all(&x.to_le_bytes()).map(|()| 1)?,
        Value::I8(x) => w.write_all(&x.to_le_bytes()).map(|()| 1)?,
        Value::U16(x) => w.write_all(&x.to_le_bytes()).map(|()| 2)?,
        Value::I16(x) => w.write_all(&x.to_le_bytes()).map(|()| 2)?,
        Value::U32(x) => w.write_all(&x.to_le_bytes()).map(|()| 4)?,
        Value::I32(x) => w.write_all(&x.to_le_bytes()).map(|()| 4)?,
        Value::F32(x) => w.write_all(&x.to_le_bytes()).map(|()| 4)?,
        Value::Bool(x) => w.write_all(&[u8::from(*x)]).map(|()| 1)?,
        Value::Str(s) => write_str(w, s)?,
        Value::U64(x) => w.write_all(&x.to_le_bytes()).map(|()| 8)?,
        Value::I64(x) => w.write_all(&x.to_le_bytes()).map(|()| 8)?,
        Value::F64(x) => w.write_all(&x.to_le_bytes()).map(|()| 8)?,
        Value::Array(ty, items) => {
            w.write_all(&(*ty as u32).to_le_bytes())?;
            w.write_all(&(items.len() as u64).to_le_bytes())?;
            let mut n = 12;
            for item in items {
                assert_eq!(item.ty(), *ty, "array of {ty:?} holds a {:?}", item.ty());
                n += write_value(w, item)?;
            }
            n
        }
    })
}

/// The metadata key/values of a GGUF file, in file order (the tensor infos and data are not
/// read).
///
/// # Errors
/// When the file cannot be read or is not GGUF v2/v3.
pub fn read_metadata(path: &Path) -> io::Result<Vec<(String, Value)>> {
    let mut r = BufReader::with_capacity(1 << 20, File::open(path)?);
    let mut magic = [0u8; 4];
    r.read_exact(&mut magic)?;
    if &magic != MAGIC {
        return Err(bad(format!("{} is not a GGUF file", path.display())));
    }
    let version = read_u32(&mut r)?;
    if !(2..=3).contains(&version) {
        return Err(bad(format!("GGUF version {version} is not supported")));
    }
    let _n_tensors = read_u64(&mut r)?;
    let n_kv = read_u64(&mut r)?;
    let mut kv = Vec::with_capacity(n_kv as usize);
    for _ in 0..n_kv {
        let key = read_str(&mut r)?;
        let ty = Type::from_u32(read_u32(&mut r)?)?;
        kv.push((key, read_value(&mut r, ty)?));
    }
    Ok(kv)
}

fn bad(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

fn read_array<const N: usize>(r: &mut impl Read) -> io::Result<[u8; N]> {
    let mut b = [0u8; N];
    r.read_exact(&mut b)?;
    Ok(b)
}

fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    read_array(r).map(u32::from_le_bytes)
}

fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    read_array(r).map(u64::from_le_bytes)
}

fn read_str(r: &mut impl Read) -> io::Result<String> {
    let n = read_u64(r)?;
    if n > 1 << 30 {
        return Err(bad(format!("string of {n} bytes")));
    }
    let mut b = vec![0u8; n as usize];
    r.read_exact(&mut b)?;
    String::from_utf8(b).map_err(|e| bad(format!("string not UTF-8: {e}")))
}

fn read_value(r: &mut impl Read, ty: Type) -> io::Result<Value> {
    Ok(match ty {
        Type::U8 => Value::U8(u8::from_le_bytes(read_array(r)?)),
        Type::I8 => Value::I8(i8::from_le_bytes(read_array(r)?)),
        Type::U16 => Value::U16(u16::from_le_bytes(read_array(r)?)),
        Type::I16 => Value::I16(i16::from_le_bytes(read_array(r)?)),
        Type::U32 => Value::U32(read_u32(r)?),
        Type::I32 => Value::I32(i32::from_le_bytes(read_array(r)?)),
        Type::F32 => Value::F32(f32::from_le_bytes(read_array(r)?)),
        Type::Bool => match read_array::<1>(r)?[0] {
            0 => Value::Bool(false),
            1 => Value::Bool(true),
            b => return Err(bad(format!("bool value {b}"))),
        },
        Type::Str => Value::Str(read_str(r)?),
        Type::U64 => Value::U64(read_u64(r)?),
        Type::I64 => Value::I64(i64::from_le_bytes(read_array(r)?)),
        Type::F64 => Value::F64(f64::from_le_bytes(read_array(r)?)),
        Type::Array => {
            let elem = Type::from_u32(read_u32(r)?)?;
            let n = read_u64(r)?;
            if n > 1 << 28 {
                return Err(bad(format!("array of {n} elements")));
            }
            let items = (0..n)
                .map(|_| read_value(r, elem))
                .collect::<io::Result<Vec<_>>>()?;
            Value::Array(elem, items)
        }
    })
}

/// IEEE 754 half precision of `x`, rounded to nearest even (what ggml's converters do).
pub fn f32_to_f16(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exp = ((bits >> 23) & 0xff) as i32;
    let man = bits & 0x007f_ffff;
    if exp == 0xff {
        // inf or NaN (keep NaN a NaN)
        return sign | 0x7c00 | if man != 0 { 0x200 } else { 0 };
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00; // overflow: inf
    }
    if e <= 0 {
        // subnormal half (or zero)
        if e < -10 {
            return sign;
        }
        let m = man | 0x0080_0000;
        let shift = (14 - e) as u32;
        let half = m >> shift;
        let rest = m & ((1 << shift) - 1);
        let mid = 1 << (shift - 1);
        let round = u32::from(rest > mid || (rest == mid && half & 1 == 1));
        return sign | (half + round) as u16;
    }
    let half = ((e as u32) << 10) | (man >> 13);
    let rest = man & 0x1fff;
    let round = u32::from(rest > 0x1000 || (rest == 0x1000 && half & 1 == 1));
    // a carry out of the mantissa moves into the exponent, as it should (up to inf)
    sign | (half + round) as u16
}

/// A small deterministic generator (the library's splitmix64, `h2o_research::eval::Rng`) with
/// normal samples (Box–Muller), so that a model written twice is the same file.
pub struct Rng(h2o_research::eval::Rng);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(h2o_research::eval::Rng::new(seed))
    }

    /// A generator for one tensor: the seed mixed with the tensor's name, so that values do not
    /// depend on the order in which tensors are made.
    pub fn for_tensor(seed: u64, name: &str) -> Rng {
        // FNV-1a over the name
        let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        Rng::new(seed ^ h)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in (0, 1].
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// `n` samples of N(0, std²).
    pub fn normal(&mut self, n: usize, std: f32) -> Vec<f32> {
        let mut out = Vec::with_capacity(n + 1);
        while out.len() < n {
            let (u, v) = (self.uniform(), self.uniform());
            let r = (-2.0 * u.ln()).sqrt() * f64::from(std);
            let t = std::f64::consts::TAU * v;
            out.push((r * t.cos()) as f32);
            out.push((r * t.sin()) as f32);
        }
        out.truncate(n);
        out
    }
}
