//! GGUF v3 reader (over memmap2 or an owned buffer) and writer.
//!
//! Every read is bounds-checked: a malformed file yields a [`GgufError`] that names the file and
//! the problem. Nothing here panics on input bytes.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use crate::quant::GgmlType;

const MAGIC: &[u8; 4] = b"GGUF";
const VERSION: u32 = 3;
const DEFAULT_ALIGNMENT: u64 = 32;
const MAX_DIMS: usize = 4;

/// What went wrong, without the file name (see [`GgufError`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GgufProblem {
    Io(String),
    BadMagic([u8; 4]),
    UnsupportedVersion(u32),
    /// A read of `need` bytes at `offset` runs past the end (`len`).
    Truncated {
        what: String,
        offset: u64,
        need: u64,
        len: u64,
    },
    /// A count or size does not fit the file or overflows.
    Overflow {
        what: String,
    },
    UnknownValueType {
        key: String,
        ty: u32,
    },
    BadStringLength {
        what: String,
        len: u64,
        remaining: u64,
    },
    InvalidUtf8 {
        what: String,
    },
    DuplicateKey(String),
    DuplicateTensor(String),
    TooManyDims {
        tensor: String,
        n_dims: u32,
    },
    UnknownTensorType {
        tensor: String,
        ty: u32,
    },
    BadShape {
        tensor: String,
        reason: String,
    },
    BadAlignment(u64),
    MisalignedTensor {
        tensor: String,
        offset: u64,
        alignment: u64,
    },
    TensorOutOfBounds {
        tensor: String,
        start: u64,
        end: u64,
        len: u64,
    },
}

impl fmt::Display for GgufProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use GgufProblem::*;
        match self {
            Io(e) => write!(f, "cannot read: {e}"),
            BadMagic(m) => write!(f, "not a GGUF file (magic {m:02x?}, expected \"GGUF\")"),
            UnsupportedVersion(v) => write!(f, "GGUF version {v} is not supported (only v3)"),
            Truncated { what, offset, need, len } => write!(
                f,
                "truncated: reading {what} needs {need} bytes at offset {offset}, but the file has {len} bytes"
            ),
            Overflow { what } => write!(f, "size overflow: {what}"),
            UnknownValueType { key, ty } => write!(f, "metadata key '{key}' has unknown value type {ty}"),
            BadStringLength { what, len, remaining } => {
                write!(f, "bad string length {len} for {what} (only {remaining} bytes remain)")
            }
            InvalidUtf8 { what } => write!(f, "{what} is not valid UTF-8"),
            DuplicateKey(k) => write!(f, "duplicate metadata key '{k}'"),
            DuplicateTensor(t) => write!(f, "duplicate tensor name '{t}'"),
            TooManyDims { tensor, n_dims } => {
                write!(f, "tensor '{tensor}' has {n_dims} dims (at most {MAX_DIMS})")
            }
            UnknownTensorType { tensor, ty } => write!(f, "tensor '{tensor}' has unknown type {ty}"),
            BadShape { tensor, reason } => write!(f, "tensor '{tensor}' has a bad shape: {reason}"),
            BadAlignment(a) => write!(f, "general.alignment {a} is not a power of two"),
            MisalignedTensor { tensor, offset, alignment } => {
                write!(f, "tensor '{tensor}' data offset {offset} is not a multiple of the alignment {alignment}")
            }
            TensorOutOfBounds { tensor, start, end, len } => {
                write!(f, "tensor '{tensor}' data [{start}, {end}) runs past the end of the file ({len} bytes)")
            }
        }
    }
}

/// A GGUF error: the file it concerns and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}: {problem}")]
pub struct GgufError {
    pub file: String,
    pub problem: GgufProblem,
}

/// The value type ids of GGUF metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    fn from_u32(v: u32) -> Option<Self> {
        use ValueType::*;
        Some(match v {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// Element type and elements (all of that type).
    Array(ValueType, Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(..) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// Any integer type that fits a u64 without loss.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any numeric type, as f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64).or(match *self {
                Value::I8(v) => Some(v as f64),
                Value::I16(v) => Some(v as f64),
                Value::I32(v) => Some(v as f64),
                Value::I64(v) => Some(v as f64),
                _ => None,
            }),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(_, v) => Some(v),
            _ => None,
        }
    }
}

/// A tensor's table entry. `offset` is absolute within the file's bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub ty: GgmlType,
    /// GGUF order: dims[0] is the innermost (row length).
    pub dims: Vec<u64>,
    pub offset: u64,
    pub bytes: u64,
}

impl TensorInfo {
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }
    /// Dimension `i`, or 1 past the tensor's rank.
    pub fn dim(&self, i: usize) -> u64 {
        self.dims.get(i).copied().unwrap_or(1)
    }
}

enum Storage {
    Mmap(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mmap(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file. Tensor data stays in the mapping (or buffer) and is borrowed on demand.
pub struct File {
    name: String,
    storage: Arc<Storage>,
    pub version: u32,
    pub alignment: u64,
    pub data_offset: u64,
    metadata: Vec<(String, Value)>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    /// The length of the image whose header this is, when the tensor data is not here.
    virtual_len: Option<u64>,
}

impl fmt::Debug for File {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("gguf::File")
            .field("name", &self.name)
            .field("bytes", &self.len())
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl File {
    /// Memory-maps and parses `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<File, GgufError> {
        let path = path.as_ref();
        let name = path.display().to_string();
        let err = |p| GgufError { file: name.clone(), problem: p };
        let f = std::fs::File::open(path).map_err(|e| err(GgufProblem::Io(e.to_string())))?;
        // SAFETY: the mapping is read-only; a file truncated under us by another process is the
        // one hazard of every mmap reader, and GGUF model files are not written while loaded.
        let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| err(GgufProblem::Io(e.to_string())))?;
        Self::parse(name, Storage::Mmap(map))
    }

    /// Parses an in-memory GGUF image; `name` is used in error messages.
    pub fn from_bytes(name: impl Into<String>, bytes: Vec<u8>) -> Result<File, GgufError> {
        Self::parse(name.into(), Storage::Owned(bytes))
    }

    /// A header without its tensor data (from [`Writer::to_header_only`]): `total` is the length
    /// the whole image would have. The tensors are described but hold no bytes here
    /// ([`File::has_data`] is false); a backend that generates them itself can use it.
    pub fn from_header(name: impl Into<String>, header: Vec<u8>, total: u64) -> Result<File, GgufError> {
        Self::parse_with(name.into(), Storage::Owned(header), Some(total))
    }

    /// Whether the tensors' bytes are here (false for [`File::from_header`]).
    pub fn has_data(&self) -> bool {
        self.virtual_len.is_none()
    }

    fn parse(name: String, storage: Storage) -> Result<File, GgufError> {
        Self::parse_with(name, storage, None)
    }

    fn parse_with(name: String, storage: Storage, virtual_len: Option<u64>) -> Result<File, GgufError> {
        let parsed = {
            let mut r = Reader { b: storage.bytes(), pos: 0 };
            parse_header(&mut r, virtual_len)
        };
        match parsed {
            Ok(h) => Ok(File {
                name,
                storage: Arc::new(storage),
                version: h.version,
                alignment: h.alignment,
                data_offset: h.data_offset,
                meta_index: h.metadata.iter().enumerate().map(|(i, (k, _))| (k.clone(), i)).collect(),
                metadata: h.metadata,
                tensor_index: h.tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect(),
                tensors: h.tensors,
                virtual_len,
            }),
            Err(problem) => Err(GgufError { file: name, problem }),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn len(&self) -> u64 {
        self.storage.bytes().len() as u64
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn bytes(&self) -> &[u8] {
        self.storage.bytes()
    }
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }
    /// The whole file when its bytes are a read-only memory mapping (not a buffer): a GPU
    /// backend may register these pages and read the tensors in place.
    pub fn mapping(&self) -> Option<&[u8]> {
        match &*self.storage {
            Storage::Mmap(m) => Some(m),
            Storage::Owned(_) => None,
        }
    }

    /// The data bytes of a tensor (bounds were checked at parse time); empty for a header-only
    /// file ([`File::has_data`]).
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        self.storage.bytes().get(t.offset as usize..(t.offset + t.bytes) as usize).unwrap_or(&[])
    }

    /// A string array from the metadata, e.g. `tokenizer.ggml.tokens`.
    pub fn string_array(&self, key: &str) -> Option<Vec<&str>> {
        let arr = self.get(key)?.as_array()?;
        arr.iter().map(|v| v.as_str()).collect()
    }
}

struct Header {
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, Value)>,
    tensors: Vec<TensorInfo>,
}

struct Reader<'a> {
    b: &'a [u8],
    pos: u64,
}

impl<'a> Reader<'a> {
    fn len(&self) -> u64 {
        self.b.len() as u64
    }
    fn remaining(&self) -> u64 {
        self.len().saturating_sub(self.pos)
    }
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], GgufProblem> {
        if n > self.remaining() {
            return Err(GgufProblem::Truncated { what: what.to_string(), offset: self.pos, need: n, len: self.len() });
        }
        let s = &self.b[self.pos as usize..(self.pos + n) as usize];
        self.pos += n;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufProblem> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    fn u32(&mut self, what: &str) -> Result<u32, GgufProblem> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64, GgufProblem> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }
    fn string(&mut self, what: &str) -> Result<String, GgufProblem> {
        let len = self.u64(what)?;
        if len > self.remaining() {
            return Err(GgufProblem::BadStringLength { what: what.to_string(), len, remaining: self.remaining() });
        }
        let s = self.take(len, what)?;
        String::from_utf8(s.to_vec()).map_err(|_| GgufProblem::InvalidUtf8 { what: what.to_string() })
    }

    fn value(&mut self, ty: ValueType, key: &str, depth: u32) -> Result<Value, GgufProblem> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.arr::<1>(key)?[0]),
            ValueType::I8 => Value::I8(self.arr::<1>(key)?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.arr(key)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.arr(key)?)),
            ValueType::U32 => Value::U32(self.u32(key)?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.arr(key)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.arr(key)?)),
            ValueType::Bool => Value::Bool(self.arr::<1>(key)?[0] != 0),
            ValueType::String => Value::String(self.string(key)?),
            ValueType::U64 => Value::U64(self.u64(key)?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.arr(key)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.arr(key)?)),
            ValueType::Array => {
                let raw = self.u32(key)?;
                let ety = ValueType::from_u32(raw)
                    .ok_or_else(|| GgufProblem::UnknownValueType { key: key.to_string(), ty: raw })?;
                if ety == ValueType::Array && depth >= 2 {
                    return Err(GgufProblem::Overflow { what: format!("arrays nested too deeply in '{key}'") });
                }
                let n = self.u64(key)?;
                // Every element takes at least one byte: a count beyond the remaining bytes is bogus.
                if n > self.remaining() {
                    return Err(GgufProblem::Overflow {
                        what: format!("array '{key}' claims {n} elements but only {} bytes remain", self.remaining()),
                    });
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(ety, key, depth + 1)?);
                }
                Value::Array(ety, v)
            }
        })
    }
}

fn align_up(x: u64, a: u64) -> Option<u64> {
    x.checked_add(a - 1).map(|v| v / a * a)
}

fn parse_header(r: &mut Reader, virtual_len: Option<u64>) -> Result<Header, GgufProblem> {
    let magic: [u8; 4] = r.arr("magic")?;
    if &magic != MAGIC {
        return Err(GgufProblem::BadMagic(magic));
    }
    let version = r.u32("version")?;
    if version != VERSION {
        return Err(GgufProblem::UnsupportedVersion(version));
    }
    let n_tensors = r.u64("tensor count")?;
    let n_kv = r.u64("metadata count")?;
    // A KV takes at least 8+4+1 bytes and a tensor info at least 8+4+4+8: counts that cannot fit
    // mean a cut file (or garbage), and must not drive allocations.
    let need = n_kv.saturating_mul(13).saturating_add(n_tensors.saturating_mul(24));
    if need > r.remaining() {
        return Err(GgufProblem::Truncated {
            what: format!("{n_kv} metadata entries and {n_tensors} tensor infos"),
            offset: r.pos,
            need,
            len: r.len(),
        });
    }

    let mut metadata = Vec::with_capacity(n_kv as usize);
    let mut seen = HashMap::new();
    for i in 0..n_kv {
        let key = r.string(&format!("metadata key #{i}"))?;
        let raw = r.u32(&key)?;
        let ty = ValueType::from_u32(raw).ok_or_else(|| GgufProblem::UnknownValueType { key: key.clone(), ty: raw })?;
        let value = r.value(ty, &key, 0)?;
        if seen.insert(key.clone(), ()).is_some() {
            return Err(GgufProblem::DuplicateKey(key));
        }
        metadata.push((key, value));
    }

    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        Some((_, v)) => v.as_u64().unwrap_or(0),
        None => DEFAULT_ALIGNMENT,
    };
    if alignment == 0 || !alignment.is_power_of_two() {
        return Err(GgufProblem::BadAlignment(alignment));
    }

    struct Raw {
        name: String,
        ty: GgmlType,
        dims: Vec<u64>,
        rel: u64,
        bytes: u64,
    }
    let mut raws = Vec::with_capacity(n_tensors as usize);
    let mut names = HashMap::new();
    for i in 0..n_tensors {
        let name = r.string(&format!("tensor name #{i}"))?;
        let n_dims = r.u32(&name)?;
        if n_dims as usize > MAX_DIMS {
            return Err(GgufProblem::TooManyDims { tensor: name, n_dims });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(r.u64(&name)?);
        }
        let raw_ty = r.u32(&name)?;
        let ty =
            GgmlType::from_u32(raw_ty).ok_or(GgufProblem::UnknownTensorType { tensor: name.clone(), ty: raw_ty })?;
        let rel = r.u64(&name)?;
        let bytes = tensor_bytes(&name, ty, &dims)?;
        if names.insert(name.clone(), ()).is_some() {
            return Err(GgufProblem::DuplicateTensor(name));
        }
        raws.push(Raw { name, ty, dims, rel, bytes });
    }

    let data_offset = align_up(r.pos, alignment).ok_or(GgufProblem::Overflow { what: "data offset".into() })?;
    let len = virtual_len.unwrap_or(r.len());
    let mut tensors = Vec::with_capacity(raws.len());
    for t in raws {
        if t.rel % alignment != 0 {
            return Err(GgufProblem::MisalignedTensor { tensor: t.name, offset: t.rel, alignment });
        }
        let start = data_offset.checked_add(t.rel);
        let end = start.and_then(|s| s.checked_add(t.bytes));
        let (Some(start), Some(end)) = (start, end) else {
            return Err(GgufProblem::Overflow {
                what: format!("tensor '{}' offset {} + {} bytes", t.name, t.rel, t.bytes),
            });
        };
        if end > len {
            return Err(GgufProblem::TensorOutOfBounds { tensor: t.name, start, end, len });
        }
        tensors.push(TensorInfo { name: t.name, ty: t.ty, dims: t.dims, offset: start, bytes: t.bytes });
    }
    Ok(Header { version, alignment, data_offset, metadata, tensors })
}

fn tensor_bytes(name: &str, ty: GgmlType, dims: &[u64]) -> Result<u64, GgufProblem> {
    let shape_err = |reason: String| GgufProblem::BadShape { tensor: name.to_string(), reason };
    let overflow = || GgufProblem::Overflow { what: format!("tensor '{name}' dims {dims:?}") };
    if dims.contains(&0) {
        return Err(shape_err(format!("zero-sized dimension in {dims:?}")));
    }
    let ne0 = dims.first().copied().unwrap_or(1);
    let (be, bb) = (ty.block_elems() as u64, ty.block_bytes() as u64);
    if ne0 % be != 0 {
        return Err(shape_err(format!("row length {ne0} is not a multiple of the {ty:?} block ({be})")));
    }
    let mut bytes = (ne0 / be).checked_mul(bb).ok_or_else(overflow)?;
    for &d in dims.iter().skip(1) {
        bytes = bytes.checked_mul(d).ok_or_else(overflow)?;
    }
    Ok(bytes)
}

/// Builds a GGUF v3 image in memory. Used by tests and `ds4 synth`.
#[derive(Default)]
pub struct Writer {
    metadata: Vec<(String, Value)>,
    tensors: Vec<(String, GgmlType, Vec<u64>, Vec<u8>)>,
    alignment: u64,
}

impl Writer {
    pub fn new() -> Self {
        Writer { metadata: Vec::new(), tensors: Vec::new(), alignment: DEFAULT_ALIGNMENT }
    }
    pub fn set(&mut self, key: impl Into<String>, value: Value) -> &mut Self {
        let key = key.into();
        if key == "general.alignment" {
            if let Some(a) = value.as_u64() {
                self.alignment = a;
            }
        }
        self.metadata.retain(|(k, _)| *k != key);
        self.metadata.push((key, value));
        self
    }
    /// Adds a tensor; `data` must be exactly the tensor's byte size.
    pub fn tensor(&mut self, name: impl Into<String>, ty: GgmlType, dims: &[u64], data: Vec<u8>) -> &mut Self {
        self.tensors.push((name.into(), ty, dims.to_vec(), data));
        self
    }

    /// The header (metadata, then tensor infos) padded to the data start, with tensor `i` placed
    /// at the next aligned offset for `sizes[i]` bytes. Returns it and each tensor's offset.
    fn header(&self, sizes: &[u64]) -> (Vec<u8>, Vec<u64>) {
        let align = self.alignment.max(1);
        let mut out = Vec::with_capacity(1 << 16);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            write_string(&mut out, k);
            out.extend_from_slice(&(v.value_type() as u32).to_le_bytes());
            write_value(&mut out, v);
        }
        let mut rel = 0u64;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for ((name, ty, dims, _), &size) in self.tensors.iter().zip(sizes) {
            write_string(&mut out, name);
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&(*ty as u32).to_le_bytes());
            out.extend_from_slice(&rel.to_le_bytes());
            offsets.push(rel);
            rel = align_up(rel.saturating_add(size), align).unwrap_or(u64::MAX);
        }
        let data_start = align_up(out.len() as u64, align).unwrap_or(u64::MAX);
        out.resize(data_start as usize, 0);
        (out, offsets)
    }

    /// The header of the image that [`Writer::to_bytes`] would write, with every tensor's size
    /// taken from its type and dims (the data may be left empty), and the image's total length.
    /// [`File::from_header`] reads it back.
    pub fn to_header_only(&self) -> (Vec<u8>, u64) {
        let sizes: Vec<u64> =
            self.tensors.iter().map(|(name, ty, dims, _)| tensor_bytes(name, *ty, dims).unwrap_or(u64::MAX)).collect();
        let (out, offsets) = self.header(&sizes);
        let align = self.alignment.max(1);
        let end = match (offsets.last(), sizes.last()) {
            (Some(&o), Some(&n)) => align_up(o.saturating_add(n), align).unwrap_or(u64::MAX),
            _ => 0,
        };
        let total = (out.len() as u64).saturating_add(end);
        (out, total)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let sizes: Vec<u64> = self.tensors.iter().map(|t| t.3.len() as u64).collect();
        let (mut out, offsets) = self.header(&sizes);
        let data_start = out.len();
        for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
            out.resize(data_start + off as usize, 0);
            out.extend_from_slice(data);
        }
        let end = align_up(out.len() as u64, self.alignment.max(1)).unwrap_or(u64::MAX) as usize;
        out.resize(end, 0);
        out
    }

    /// Each tensor's data size from its type and dims (not from the bytes given to `tensor`).
    fn sizes_from_types(&self) -> Result<Vec<u64>, String> {
        let size = |(name, ty, dims, _): &(String, GgmlType, Vec<u64>, Vec<u8>)| {
            tensor_bytes(name, *ty, dims).map_err(|e| format!("tensor '{name}': {e:?}"))
        };
        self.tensors.iter().map(size).collect()
    }

    /// The image [`Writer::to_bytes`] would make, tensor `i`'s bytes given by `data(i)`, drawn in
    /// parallel straight into one allocation of the image's size (the tensors' sizes come from
    /// their types and dims). A 9.5 GB preset took 45 s and twice its size in memory through
    /// `to_bytes`; this holds the image and the tensors being drawn.
    pub fn to_bytes_parallel(&self, data: impl Fn(usize) -> Vec<u8> + Sync) -> Result<Vec<u8>, String> {
        use rayon::prelude::*;
        let sizes = self.sizes_from_types()?;
        let (header, offsets) = self.header(&sizes);
        let align = self.alignment.max(1);
        let end = match (offsets.last(), sizes.last()) {
            (Some(&o), Some(&n)) => align_up(o.saturating_add(n), align).ok_or("image too large")?,
            _ => 0,
        };
        let total = usize::try_from(header.len() as u64 + end).map_err(|_| "image too large")?;
        let mut image = vec![0u8; total];
        let (head, mut rest) = image.split_at_mut(header.len());
        head.copy_from_slice(&header);
        let mut slots = Vec::with_capacity(sizes.len());
        let mut pos = 0u64;
        for (i, (&off, &size)) in offsets.iter().zip(&sizes).enumerate() {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut((off - pos) as usize);
            let (slot, tail) = tail.split_at_mut(size as usize);
            slots.push((i, slot));
            rest = tail;
            pos = off + size;
        }
        slots.into_par_iter().try_for_each(|(i, slot)| {
            let bytes = data(i);
            if bytes.len() != slot.len() {
                return Err(format!("tensor '{}': {} bytes given for {}", self.tensors[i].0, bytes.len(), slot.len()));
            }
            slot.copy_from_slice(&bytes);
            Ok(())
        })?;
        Ok(image)
    }

    /// Writes the image [`Writer::to_bytes`] would make to `out` one tensor at a time: the
    /// tensors' sizes come from their types and dims, and `data(i)` gives tensor `i`'s bytes when
    /// they are written (so a model larger than memory can be written). Returns the length.
    pub fn write_streamed(
        &self,
        out: &mut impl std::io::Write,
        mut data: impl FnMut(usize) -> Vec<u8>,
    ) -> std::io::Result<u64> {
        let invalid = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, m);
        let sizes = self.sizes_from_types().map_err(invalid)?;
        let (header, offsets) = self.header(&sizes);
        out.write_all(&header)?;
        let mut pos = 0u64;
        let zeros = vec![0u8; self.alignment.max(1) as usize];
        for (i, (&off, &size)) in offsets.iter().zip(&sizes).enumerate() {
            out.write_all(&zeros[..(off - pos) as usize])?;
            let bytes = data(i);
            if bytes.len() as u64 != size {
                let name = &self.tensors[i].0;
                return Err(invalid(format!("tensor '{name}': {} bytes given for {size}", bytes.len())));
            }
            out.write_all(&bytes)?;
            pos = off + size;
        }
        let end = align_up(pos, self.alignment.max(1)).unwrap_or(pos);
        out.write_all(&zeros[..(end - pos) as usize])?;
        Ok(header.len() as u64 + end)
    }

    pub fn write_file(&self, path: impl AsRef<Path>) -> std::io::Result<()> {
        std::fs::write(path, self.to_bytes())
    }
}

fn write_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn write_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => write_string(out, s),
        Value::Array(ety, items) => {
            out.extend_from_slice(&(*ety as u32).to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for it in items {
                write_value(out, it);
            }
        }
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}

/// Convenience constructors for metadata arrays.
pub fn u32_array(v: &[u32]) -> Value {
    Value::Array(ValueType::U32, v.iter().map(|&x| Value::U32(x)).collect())
}
pub fn f32_array(v: &[f32]) -> Value {
    Value::Array(ValueType::F32, v.iter().map(|&x| Value::F32(x)).collect())
}
pub fn string_array<S: AsRef<str>>(v: &[S]) -> Value {
    Value::Array(ValueType::String, v.iter().map(|s| Value::String(s.as_ref().to_string())).collect())
}
