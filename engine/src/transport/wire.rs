//! The byte format of what crosses between ranks: little-endian integers and floats, strings and
//! byte runs with a length in front, and tensors as dtype, shape and raw elements. A reader checks
//! every length against what is left, so a truncated or corrupted message is an error, never a
//! panic or an allocation of a size read from the wire.
use crate::{DType, Device, Error, Result, Tensor};

/// Appends values to a message.
#[derive(Default)]
pub(crate) struct Writer {
    pub bytes: Vec<u8>,
}

impl Writer {
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.bytes.push(v);
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn usize(&mut self, v: usize) -> &mut Self {
        self.u64(v as u64)
    }
    pub fn f64(&mut self, v: f64) -> &mut Self {
        self.bytes.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn opt_usize(&mut self, v: Option<usize>) -> &mut Self {
        self.u64(v.map_or(u64::MAX, |v| v as u64))
    }
    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.u64(v.len() as u64);
        self.bytes.extend_from_slice(v);
        self
    }
    pub fn str(&mut self, v: &str) -> &mut Self {
        self.bytes(v.as_bytes())
    }
    /// A tensor's dtype, shape and elements (copied to the host first if it lives on a GPU).
    pub fn tensor(&mut self, t: &Tensor) -> Result<&mut Self> {
        self.u8(dtype_code(t.dtype()));
        self.usize(t.dims().len());
        for &d in t.dims() {
            self.usize(d);
        }
        let data = t.try_to_le_bytes()?;
        self.bytes(&data);
        Ok(self)
    }
}

/// Reads values back in the order they were written.
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
}

fn truncated() -> Error {
    Error::invalid("transport message", "truncated or corrupted message from another rank")
}

impl<'a> Reader<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.bytes.len() {
            return Err(truncated());
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("eight bytes")))
    }
    pub fn usize(&mut self) -> Result<usize> {
        usize::try_from(self.u64()?).map_err(|_| truncated())
    }
    /// A count of items each at least `min_item_bytes` long: refused when the message cannot hold
    /// that many.
    pub fn count(&mut self, min_item_bytes: usize) -> Result<usize> {
        let n = self.usize()?;
        if n.saturating_mul(min_item_bytes.max(1)) > self.bytes.len() {
            return Err(truncated());
        }
        Ok(n)
    }
    pub fn f64(&mut self) -> Result<f64> {
        Ok(f64::from_le_bytes(self.take(8)?.try_into().expect("eight bytes")))
    }
    pub fn opt_usize(&mut self) -> Result<Option<usize>> {
        let v = self.u64()?;
        Ok((v != u64::MAX).then_some(v as usize))
    }
    pub fn bytes(&mut self) -> Result<&'a [u8]> {
        let n = self.usize()?;
        self.take(n)
    }
    pub fn string(&mut self) -> Result<String> {
        String::from_utf8(self.bytes()?.to_vec()).map_err(|_| truncated())
    }
    /// A tensor, created on `device`.
    pub fn tensor(&mut self, device: &Device) -> Result<Tensor> {
        let dtype = dtype_of(self.u8()?)?;
        let ndim = self.count(8)?;
        let dims = (0..ndim).map(|_| self.usize()).collect::<Result<Vec<_>>>()?;
        let data = self.bytes()?;
        let numel = dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).ok_or_else(truncated)?;
        if numel.checked_mul(dtype.size_in_bytes()) != Some(data.len()) {
            return Err(truncated());
        }
        Tensor::from_le_bytes(data, dtype, dims, device)
    }
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

fn dtype_code(dtype: DType) -> u8 {
    match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
    }
}

fn dtype_of(code: u8) -> Result<DType> {
    Ok(match code {
        0 => DType::F32,
        1 => DType::F16,
        2 => DType::BF16,
        _ => return Err(truncated()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_and_tensors_round_trip_and_truncation_is_an_error() {
        let host = Device::host();
        let t = Tensor::from_vec(vec![1.0, -2.5, 3.0, 4.0, 5.0, 6.0], [2, 3], &host).unwrap();
        let mut w = Writer::default();
        w.u64(7).f64(0.5).opt_usize(None).opt_usize(Some(3)).str("stage").tensor(&t).unwrap();
        let mut r = Reader::new(&w.bytes);
        assert_eq!(r.u64().unwrap(), 7);
        assert_eq!(r.f64().unwrap(), 0.5);
        assert_eq!(r.opt_usize().unwrap(), None);
        assert_eq!(r.opt_usize().unwrap(), Some(3));
        assert_eq!(r.string().unwrap(), "stage");
        assert!(r.tensor(&host).unwrap().bit_eq(&t));
        assert!(r.is_empty());
        for cut in 0..w.bytes.len() {
            let mut r = Reader::new(&w.bytes[..cut]);
            let all = (|| -> Result<()> {
                r.u64()?;
                r.f64()?;
                r.opt_usize()?;
                r.opt_usize()?;
                r.string()?;
                r.tensor(&host)?;
                Ok(())
            })();
            assert!(all.is_err(), "a message cut at {cut} bytes must be refused");
        }
    }
}
