//! Bounds checks of a GGUF file around candle-core's reader. candle allocates every length
//! the header claims before reading it (`vec![0; len]` for a string, `Vec::with_capacity`
//! for an array, the claimed byte size of a tensor), and divides by `general.alignment`
//! unchecked, so one corrupt number panics or aborts the process (the fuzz test found a
//! capacity overflow within three inputs). [`check_header`] walks the same layout first —
//! magic, version, counts, metadata values, tensor infos — checking only that each claimed
//! length fits the bytes that remain (it keeps nothing; candle still does the parsing), and
//! [`check_tensors`] checks every tensor's extent against the file once candle has parsed.

use std::io::{BufReader, Read};
use std::path::Path;

use crate::error::{fail, Context, Result};
use candle_core::quantized::gguf_file::Content;
use kvplug_core::files::open_regular;

/// Deepest array nesting accepted (real files nest at most one level).
const MAX_DEPTH: usize = 4;
/// Most dimensions of a tensor (ggml's `GGML_MAX_DIMS`).
const MAX_DIMS: u64 = 4;
/// The one metadata key whose value candle computes with unchecked.
const ALIGNMENT_KEY: &[u8; 17] = b"general.alignment";

/// A reader that knows how many bytes remain.
struct Cursor<R> {
    r: R,
    left: u64,
}

impl<R: Read> Cursor<R> {
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        self.r.read_exact(&mut b).context("the header ends early")?;
        self.left -= N as u64;
        Ok(b)
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }
    /// Skips `n` bytes the header claims, refusing more than remain.
    fn skip(&mut self, n: u64, what: &str) -> Result<()> {
        if n > self.left {
            fail!(
                Model,
                "{what} claims {n} bytes but only {} remain in the file",
                self.left
            );
        }
        std::io::copy(&mut (&mut self.r).take(n), &mut std::io::sink())?;
        self.left -= n;
        Ok(())
    }
    fn string(&mut self, what: &str) -> Result<()> {
        let n = self.u64()?;
        self.skip(n, what)
    }
    /// Skips one metadata value of `ty`.
    fn value(&mut self, ty: u32, depth: usize) -> Result<()> {
        match ty {
            0 | 1 | 7 => self.skip(1, "a value"),
            2 | 3 => self.skip(2, "a value"),
            4..=6 => self.skip(4, "a value"),
            10..=12 => self.skip(8, "a value"),
            8 => self.string("a string value"),
            9 => {
                if depth >= MAX_DEPTH {
                    fail!(Model, "arrays nested deeper than {MAX_DEPTH}");
                }
                let elem = self.u32()?;
                let n = self.u64()?;
                // Every element takes at least one byte: a count beyond the bytes left is
                // a lie, whatever the element type.
                if n > self.left {
                    fail!(
                        Model,
                        "an array claims {n} elements but only {} bytes remain",
                        self.left
                    );
                }
                for _ in 0..n {
                    self.value(elem, depth + 1)?;
                }
                Ok(())
            }
            other => fail!(Model, "unknown metadata value type {other}"),
        }
    }
}

/// Walks the header of the GGUF at `path`, refusing any length that does not fit the file.
pub fn check_header(path: &Path) -> Result<()> {
    let (file, len) = open_regular(path)?;
    let mut c = Cursor {
        r: BufReader::new(file),
        left: len,
    };
    let fail = |e: crate::Error| e.context(format!("{}: not a valid GGUF file", path.display()));
    (|| {
        if &c.bytes::<4>()? != b"GGUF" {
            fail!(Model, "no GGUF magic");
        }
        match c.u32()? {
            2 | 3 => {}
            v => fail!(Model, "GGUF version {v} is not supported (2 or 3)"),
        }
        let tensors = c.u64()?;
        let kvs = c.u64()?;
        // A key/value takes at least 12 bytes, a tensor info at least 24.
        if kvs
            .saturating_mul(12)
            .saturating_add(tensors.saturating_mul(24))
            > c.left
        {
            fail!(
                Model,
                "{kvs} metadata entries and {tensors} tensors cannot fit in the file"
            );
        }
        for _ in 0..kvs {
            let n = c.u64()?;
            let alignment_key = if n == ALIGNMENT_KEY.len() as u64 {
                c.bytes::<17>()? == *ALIGNMENT_KEY
            } else {
                c.skip(n, "a metadata key")?;
                false
            };
            let ty = c.u32()?;
            if !alignment_key {
                c.value(ty, 0)?;
                continue;
            }
            // candle divides by the alignment unchecked; the format wants a power of two.
            let a = match ty {
                0 | 1 => u64::from(c.bytes::<1>()?[0]),
                2 | 3 => u64::from(u16::from_le_bytes(c.bytes()?)),
                4 | 5 => u64::from(c.u32()?),
                _ => {
                    c.value(ty, 0)?;
                    continue;
                }
            };
            // Negative signed values make candle use its default: only the magnitude bits
            // read here matter when they are not.
            let negative = match ty {
                1 => a >= 0x80,
                3 => a >= 0x8000,
                5 => a >= 0x8000_0000,
                _ => false,
            };
            if !negative && !a.is_power_of_two() {
                fail!(Model, "general.alignment {a} is not a power of two");
            }
        }
        for _ in 0..tensors {
            c.string("a tensor name")?;
            let dims = c.u32()? as u64;
            if dims > MAX_DIMS {
                fail!(
                    Model,
                    "a tensor with {dims} dimensions (at most {MAX_DIMS})"
                );
            }
            c.skip(8 * dims + 12, "a tensor info")?;
        }
        Ok(())
    })()
    .map_err(fail)
}

/// Checks every tensor's extent (element count, whole blocks, bytes inside the file) of a
/// parsed `content` of a `len`-byte file.
pub fn check_tensors(content: &Content, len: u64, path: &Path) -> Result<()> {
    let bad = |m: String| crate::Error::Model(format!("{}: {m}", path.display()));
    for (name, info) in &content.tensor_infos {
        let elems = info
            .shape
            .dims()
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d as u64))
            .ok_or_else(|| bad(format!("tensor '{name}': its element count overflows")))?;
        let block = info.ggml_dtype.block_size() as u64;
        // candle views an empty read buffer (a dangling pointer) as blocks: refused.
        if elems == 0 {
            return Err(bad(format!("tensor '{name}' has no elements")));
        }
        if elems % block != 0 {
            return Err(bad(format!(
                "tensor '{name}': {elems} elements are not whole {:?} blocks of {block}",
                info.ggml_dtype
            )));
        }
        let bytes = (elems / block).checked_mul(info.ggml_dtype.type_size() as u64);
        let end = bytes.and_then(|b| {
            content
                .tensor_data_offset
                .checked_add(info.offset)?
                .checked_add(b)
        });
        if end.is_none_or(|e| e > len) {
            return Err(bad(format!(
                "tensor '{name}' ({elems} {:?} elements at offset {}) lies past the end of the \
                 {len}-byte file",
                info.ggml_dtype, info.offset
            )));
        }
    }
    Ok(())
}
