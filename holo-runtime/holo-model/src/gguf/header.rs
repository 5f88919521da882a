//! A GGUF file's header — metadata and tensor descriptions — read here rather than by candle: candle
//! 0.11's reader refuses a whole file at the first tensor of a type it does not know, and every
//! gpt-oss file keeps its experts in one, MXFP4 (ggml type 39). Tensors of the types candle knows are
//! still made into candle's [`QTensor`]s; MXFP4 ones are dequantized by [`crate::mxfp4`]; any other
//! type is refused when the tensor is read, by its name and type, so the rest of the file (tokenizer,
//! template, other tensors) stays readable.
//!
//! The layout is GGUF's (versions 1 to 3): magic `GGUF`, version, tensor and metadata counts, the
//! metadata as (key, type, value), then per tensor its name, dimensions (innermost first), type and
//! offset into the data, which starts at the next multiple of `general.alignment` (32).

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};

use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Result, Shape};

use crate::mxfp4;

/// The bounds llama.cpp's reader keeps (`GGUF_MAX_STRING_LENGTH`, array elements, `GGML_MAX_DIMS`):
/// a damaged or hostile header fails instead of asking for memory it does not describe.
const MAX_LENGTH: u64 = 1 << 30;
const MAX_DIMS: u32 = 4;
const MAX_DEPTH: usize = 64;
const DEFAULT_ALIGNMENT: u64 = 32;

/// A tensor's storage type (ggml's `ggml_type` numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorType {
    /// One of the types candle reads and dequantizes.
    Candle(GgmlDType),
    /// Blocks of 32 values: one E8M0 scale byte, then 16 bytes of 4-bit E2M1 codes ([`mxfp4`]).
    Mxfp4,
    /// A type this runtime does not read, by its number.
    Other(u32),
}

impl TensorType {
    fn from_u32(number: u32) -> Self {
        use GgmlDType::*;
        TensorType::Candle(match number {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2K,
            11 => Q3K,
            12 => Q4K,
            13 => Q5K,
            14 => Q6K,
            15 => Q8K,
            30 => BF16,
            39 => return TensorType::Mxfp4,
            other => return TensorType::Other(other),
        })
    }

    /// The values per block and the bytes per block, when the type is read here.
    fn block(self) -> Option<(usize, usize)> {
        match self {
            TensorType::Candle(dtype) => Some((dtype.block_size(), dtype.type_size())),
            TensorType::Mxfp4 => Some((mxfp4::BLOCK_VALUES, mxfp4::BLOCK_BYTES)),
            TensorType::Other(_) => None,
        }
    }
}

impl std::fmt::Display for TensorType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TensorType::Candle(dtype) => write!(f, "{dtype:?}"),
            TensorType::Mxfp4 => f.write_str("MXFP4 (39)"),
            // ggml.h's names of the types candle lacks.
            TensorType::Other(number) => {
                let name = match number {
                    16 => "IQ2_XXS",
                    17 => "IQ2_XS",
                    18 => "IQ3_XXS",
                    19 => "IQ1_S",
                    20 => "IQ4_NL",
                    21 => "IQ3_S",
                    22 => "IQ2_S",
                    23 => "IQ4_XS",
                    24 => "I8",
                    25 => "I16",
                    26 => "I32",
                    27 => "I64",
                    28 => "F64",
                    29 => "IQ1_M",
                    34 => "TQ1_0",
                    35 => "TQ2_0",
                    40 => "NVFP4",
                    41 => "Q1_0",
                    _ => "unknown",
                };
                write!(f, "{name} ({number})")
            }
        }
    }
}

/// The types [`TensorInfo::read`] and [`TensorInfo::expert`] read, for error messages.
pub const READ_TYPES: &str =
    "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K … Q6_K, Q8_K, MXFP4";

/// Where one tensor lies in the file and how it is stored.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    pub kind: TensorType,
    /// Outermost dimension first, as candle and Hugging Face order them (the file lists them innermost
    /// first).
    pub shape: Shape,
    /// From the start of the tensor data.
    pub offset: u64,
}

/// The metadata and tensors of a GGUF file's header.
#[derive(Debug)]
pub struct Header {
    pub metadata: HashMap<String, Value>,
    pub tensors: HashMap<String, TensorInfo>,
    /// Where the tensor data starts in the file.
    pub data_offset: u64,
}

struct Reader<'a, R> {
    inner: &'a mut R,
    /// Version 1 wrote lengths and dimensions as 32-bit numbers, later versions as 64-bit ones.
    wide: bool,
    size: u64,
}

impl<R: Read + Seek> Reader<'_, R> {
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut bytes = [0u8; N];
        self.inner.read_exact(&mut bytes)?;
        Ok(bytes)
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }

    fn length(&mut self) -> Result<u64> {
        let length = match self.wide {
            true => self.u64()?,
            false => self.u32()? as u64,
        };
        let left = self.size.saturating_sub(self.inner.stream_position()?);
        if length > MAX_LENGTH || length > left {
            candle_core::bail!("a length of {length} where {left} bytes are left in the file");
        }
        Ok(length)
    }

    fn string(&mut self) -> Result<String> {
        let mut bytes = vec![0u8; self.length()? as usize];
        self.inner.read_exact(&mut bytes)?;
        // Some writers end strings with NULs; GGUF's strings are UTF-8, but not every file's are.
        while bytes.last() == Some(&0) {
            bytes.pop();
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn value(&mut self, kind: u32, depth: usize) -> Result<Value> {
        if depth > MAX_DEPTH {
            candle_core::bail!("metadata arrays nested deeper than {MAX_DEPTH}");
        }
        Ok(match kind {
            0 => Value::U8(u8::from_le_bytes(self.bytes()?)),
            1 => Value::I8(i8::from_le_bytes(self.bytes()?)),
            2 => Value::U16(u16::from_le_bytes(self.bytes()?)),
            3 => Value::I16(i16::from_le_bytes(self.bytes()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.bytes()?)),
            6 => Value::F32(f32::from_le_bytes(self.bytes()?)),
            7 => match self.bytes::<1>()?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                other => candle_core::bail!("a boolean of value {other}"),
            },
            8 => Value::String(self.string()?),
            9 => {
                let kind = self.u32()?;
                let length = self.length()?;
                let mut items = Vec::with_capacity(length.min(1 << 16) as usize);
                for _ in 0..length {
                    items.push(self.value(kind, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.bytes()?)),
            12 => Value::F64(f64::from_le_bytes(self.bytes()?)),
            other => candle_core::bail!("metadata value type {other} is not GGUF's"),
        })
    }
}

impl Header {
    /// Reads the header at the start of `reader`.
    pub fn read<R: Read + Seek>(reader: &mut R) -> Result<Header> {
        let size = reader.seek(SeekFrom::End(0))?;
        reader.seek(SeekFrom::Start(0))?;
        let mut reader = Reader {
            inner: reader,
            wide: true,
            size,
        };
        let magic = reader.bytes::<4>()?;
        if &magic != b"GGUF" {
            candle_core::bail!("no GGUF magic (the file starts with {magic:02x?})");
        }
        let version = reader.u32()?;
        if !(1..=3).contains(&version) {
            candle_core::bail!("GGUF version {version}; versions 1 to 3 are read");
        }
        reader.wide = version > 1;
        let tensor_count = reader.length()?;
        let metadata_count = reader.length()?;
        let mut metadata = HashMap::new();
        for _ in 0..metadata_count {
            let key = reader.string()?;
            let kind = reader.u32()?;
            let value = reader
                .value(kind, 0)
                .map_err(|error| candle_core::Error::Msg(format!("metadata `{key}`: {error}")))?;
            metadata.insert(key, value);
        }
        let mut tensors = HashMap::new();
        for _ in 0..tensor_count {
            let name = reader.string()?;
            let rank = reader.u32()?;
            if rank > MAX_DIMS {
                candle_core::bail!("tensor {name} has {rank} dimensions; at most {MAX_DIMS}");
            }
            let mut dims = (0..rank)
                .map(|_| match reader.wide {
                    true => reader.u64().map(|dim| dim as usize),
                    false => reader.u32().map(|dim| dim as usize),
                })
                .collect::<Result<Vec<usize>>>()?;
            dims.reverse();
            let kind = TensorType::from_u32(reader.u32()?);
            let offset = reader.u64()?;
            let info = TensorInfo {
                name: name.clone(),
                kind,
                shape: Shape::from(dims),
                offset,
            };
            tensors.insert(name, info);
        }
        let alignment = match metadata.get("general.alignment") {
            Some(Value::U32(alignment)) if *alignment > 0 => *alignment as u64,
            _ => DEFAULT_ALIGNMENT,
        };
        let end = reader.inner.stream_position()?;
        Ok(Header {
            metadata,
            tensors,
            data_offset: end.div_ceil(alignment) * alignment,
        })
    }
}

impl TensorInfo {
    fn unreadable(&self) -> candle_core::Error {
        candle_core::Error::Msg(format!(
            "tensor {} is of ggml type {}, which this runtime does not read (it reads {READ_TYPES})",
            self.name, self.kind
        ))
    }

    /// The bytes the tensor's blocks take in the file (and in memory, kept as they are), when its type
    /// is one read here.
    pub fn stored_bytes(&self) -> Option<u64> {
        let (values, bytes) = self.kind.block()?;
        Some((self.shape.elem_count() / values * bytes) as u64)
    }

    /// The bytes of `count` values starting `start` values into the tensor (both whole blocks).
    fn bytes<R: Read + Seek>(
        &self,
        reader: &mut R,
        data_offset: u64,
        start: usize,
        count: usize,
    ) -> Result<Vec<u8>> {
        let (values, bytes) = self.kind.block().ok_or_else(|| self.unreadable())?;
        if !start.is_multiple_of(values) || !count.is_multiple_of(values) {
            candle_core::bail!(
                "tensor {} ({}, shape {:?}) does not split into blocks of {values} values",
                self.name,
                self.kind,
                self.shape.dims()
            );
        }
        let from = data_offset + self.offset + (start / values * bytes) as u64;
        let length = count / values * bytes;
        let size = reader.seek(SeekFrom::End(0))?;
        if from + length as u64 > size {
            candle_core::bail!(
                "tensor {} needs bytes {from}..{} of a file of {size}",
                self.name,
                from + length as u64
            );
        }
        let mut data = vec![0u8; length];
        reader.seek(SeekFrom::Start(from))?;
        reader.read_exact(&mut data)?;
        Ok(data)
    }

    /// The whole tensor as candle's blocks (on the CPU), for the types candle knows.
    pub fn read<R: Read + Seek>(&self, reader: &mut R, data_offset: u64) -> Result<QTensor> {
        let dtype = match self.kind {
            TensorType::Candle(dtype) => dtype,
            TensorType::Mxfp4 => candle_core::bail!(
                "tensor {} is of ggml type {}, which is read only as a mixture's experts",
                self.name,
                self.kind
            ),
            TensorType::Other(_) => return Err(self.unreadable()),
        };
        let data = self.bytes(reader, data_offset, 0, self.shape.elem_count())?;
        qtensor_from_ggml(dtype, &data, self.shape.dims().to_vec(), &Device::Cpu)
    }

    /// The leading dimension (a mixture's experts, `[experts, …]`) and the shape of each of its slices.
    pub fn expert_shape(&self) -> Result<(usize, Vec<usize>)> {
        match self.shape.dims().split_first() {
            Some((&count, slice)) => Ok((count, slice.to_vec())),
            None => candle_core::bail!("tensor {} has no dimensions", self.name),
        }
    }

    /// Slice `e` of the leading dimension as the file stores it, read on its own: loading holds one
    /// expert's bytes, not the whole stack's.
    pub fn expert_bytes<R: Read + Seek>(
        &self,
        reader: &mut R,
        data_offset: u64,
        e: usize,
    ) -> Result<Vec<u8>> {
        let (_, slice) = self.expert_shape()?;
        let each: usize = slice.iter().product();
        self.bytes(reader, data_offset, e * each, each)
    }

    /// Slice `e` of the leading dimension dequantized to f32 on the CPU.
    pub fn expert<R: Read + Seek>(
        &self,
        reader: &mut R,
        data_offset: u64,
        e: usize,
    ) -> Result<candle_core::Tensor> {
        let (_, slice) = self.expert_shape()?;
        let data = self.expert_bytes(reader, data_offset, e)?;
        match self.kind {
            TensorType::Candle(dtype) => {
                qtensor_from_ggml(dtype, &data, slice, &Device::Cpu)?.dequantize(&Device::Cpu)
            }
            TensorType::Mxfp4 => {
                candle_core::Tensor::from_vec(mxfp4::dequantize_ggml(&data), slice, &Device::Cpu)
            }
            TensorType::Other(_) => Err(self.unreadable()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A version-3 GGUF file of `tensors` (name, ggml type number, dims outermost first, data) and one
    /// metadata string.
    fn file(tensors: &[(&str, u32, &[u64], &[u8])]) -> Vec<u8> {
        let string = |out: &mut Vec<u8>, text: &str| {
            out.extend((text.len() as u64).to_le_bytes());
            out.extend(text.as_bytes());
        };
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((tensors.len() as u64).to_le_bytes());
        out.extend(1u64.to_le_bytes());
        string(&mut out, "general.architecture");
        out.extend(8u32.to_le_bytes());
        string(&mut out, "gpt-oss");
        let mut offset = 0u64;
        for (name, kind, dims, data) in tensors {
            string(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for dim in dims.iter().rev() {
                out.extend(dim.to_le_bytes());
            }
            out.extend(kind.to_le_bytes());
            out.extend(offset.to_le_bytes());
            offset += (data.len() as u64).div_ceil(32) * 32;
        }
        out.resize(out.len().div_ceil(32) * 32, 0);
        for (_, _, _, data) in tensors {
            out.extend(*data);
            out.resize(out.len().div_ceil(32) * 32, 0);
        }
        out
    }

    #[test]
    fn mxfp4_experts_read_beside_candles_types_and_other_types_are_refused_by_name() {
        let floats: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        // Two experts of one block each: scale 2^0 and 2^1, codes 0..15 then 15..0.
        let mut blocks = Vec::new();
        for (scale, codes) in [
            (127u8, (0..16).collect::<Vec<u8>>()),
            (128, (0..16).rev().collect()),
        ] {
            blocks.push(scale);
            // Value i in the low nibble of byte i, value i + 16 in its high nibble.
            blocks.extend((0..16).map(|i| codes[i] | (codes[(i + 8) % 16] << 4)));
        }
        let bytes = file(&[
            ("norm.weight", 0, &[2], &floats),
            ("blk.0.ffn_up_exps.weight", 39, &[2, 1, 32], &blocks),
            ("blk.0.ffn_down_exps.weight", 20, &[2, 1, 32], &[0; 36]),
        ]);
        let mut reader = std::io::Cursor::new(bytes);
        let header = Header::read(&mut reader).unwrap();
        assert!(matches!(
            header.metadata["general.architecture"],
            Value::String(ref arch) if arch == "gpt-oss"
        ));
        let norm = header.tensors["norm.weight"]
            .read(&mut reader, header.data_offset)
            .unwrap();
        let norm: Vec<f32> = norm.dequantize(&Device::Cpu).unwrap().to_vec1().unwrap();
        assert_eq!(norm, [1.5, -2.0]);

        let up = &header.tensors["blk.0.ffn_up_exps.weight"];
        assert_eq!(
            (up.kind, up.shape.dims()),
            (TensorType::Mxfp4, &[2, 1, 32][..])
        );
        let experts: Vec<Vec<f32>> = (0..2)
            .map(|e| {
                let expert = up.expert(&mut reader, header.data_offset, e).unwrap();
                expert.flatten_all().unwrap().to_vec1().unwrap()
            })
            .collect();
        let e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
        let value = |code: u8| match code < 8 {
            true => e2m1[code as usize],
            false => -e2m1[code as usize - 8],
        };
        let first: Vec<f32> = (0..16)
            .chain((0..16).map(|i| (i + 8) % 16))
            .map(value)
            .collect();
        assert_eq!(experts[0], first);
        let second: Vec<f32> = (0..16u8)
            .rev()
            .chain((0..16).map(|i| 15 - (i + 8) % 16))
            .map(|code| 2.0 * value(code))
            .collect();
        assert_eq!(experts[1], second);

        let error = header.tensors["blk.0.ffn_down_exps.weight"]
            .expert(&mut reader, header.data_offset, 0)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("blk.0.ffn_down_exps.weight") && error.contains("IQ4_NL (20)"),
            "{error}"
        );
        let error = up
            .read(&mut reader, header.data_offset)
            .unwrap_err()
            .to_string();
        assert!(error.contains("MXFP4 (39)"), "{error}");
    }

    #[test]
    fn a_file_that_is_not_gguf_is_refused() {
        let mut reader = std::io::Cursor::new(b"GGML\x03\0\0\0".to_vec());
        let error = Header::read(&mut reader).unwrap_err().to_string();
        assert!(error.contains("no GGUF magic"), "{error}");
    }
}
