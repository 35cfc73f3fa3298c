//! A checkpoint's metadata read from its header alone, without reading or allocating any tensor:
//! what a program needs before it can build the model (the run spec, the model's name).
//!
//! A safetensors file starts with the header's length as a little-endian `u64`, then the header,
//! a JSON object whose `__metadata__` entry maps strings to strings. Only those bytes are read.
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::Path;

use super::{check_format_version, checkpoint_error};
use crate::{Error, Result};

/// The largest header [`read_metadata`] accepts (safetensors' own limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// The metadata map of the safetensors file at `path`, read from its header only: every key the
/// writer stored, [`super::FORMAT_VERSION_KEY`] included (and, for a training checkpoint,
/// [`super::STEP_KEY`], [`super::SEED_KEY`] and the trainer's metadata, such as the run spec
/// under `conveyor.spec`). An [`Error::Io`] when the file cannot be read, an
/// [`Error::Checkpoint`] when its header is not a safetensors header or names a newer format.
///
/// ```
/// use std::collections::BTreeMap;
/// use conveyor_engine::checkpoint::{self, FORMAT_VERSION_KEY};
/// use conveyor_engine::{Device, Tensor};
///
/// let path = std::env::temp_dir().join(format!("read-metadata-{}.safetensors", std::process::id()));
/// let weight = Tensor::from_vec(vec![1.0, 2.0], [2], &Device::host())?;
/// let metadata = BTreeMap::from([("conveyor.spec".to_string(), "[model]\nname = \"mlp\"\n".to_string())]);
/// checkpoint::save_with_metadata(&path, &[("fc.weight", &weight)], &metadata)?;
///
/// let read = checkpoint::read_metadata(&path)?;
/// assert_eq!(read["conveyor.spec"], "[model]\nname = \"mlp\"\n");
/// assert_eq!(read[FORMAT_VERSION_KEY], "1");
/// std::fs::remove_file(&path).unwrap();
/// # Ok::<(), conveyor_engine::Error>(())
/// ```
pub fn read_metadata(path: impl AsRef<Path>) -> Result<BTreeMap<String, String>> {
    let path = path.as_ref();
    let io_error = |source| Error::Io { path: path.display().to_string(), source };
    let mut file = File::open(path).map_err(io_error)?;
    let file_len = file.metadata().map_err(io_error)?.len();
    let corrupt = |what: String| {
        checkpoint_error(
            path,
            format!(
                "not a valid safetensors file ({what}; {file_len} bytes on disk); it is truncated or corrupt, \
                 restore it from an earlier checkpoint or save it again"
            ),
        )
    };
    let mut length = [0u8; 8];
    if file_len < 8 {
        return Err(corrupt("no header length".to_string()));
    }
    file.read_exact(&mut length).map_err(io_error)?;
    let header_len = u64::from_le_bytes(length);
    if header_len > MAX_HEADER_BYTES || header_len > file_len - 8 {
        return Err(corrupt(format!("a header of {header_len} bytes")));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(io_error)?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| corrupt(format!("its header is not a JSON object: {e}")))?;
    let metadata = match header.get("__metadata__") {
        None | Some(serde_json::Value::Null) => BTreeMap::new(),
        Some(serde_json::Value::Object(entries)) => entries
            .iter()
            .map(|(key, value)| match value {
                serde_json::Value::String(value) => Ok((key.clone(), value.clone())),
                other => Err(corrupt(format!("metadata `{key}` is {other}, not a string"))),
            })
            .collect::<Result<BTreeMap<String, String>>>()?,
        Some(other) => return Err(corrupt(format!("`__metadata__` is {other}, not an object"))),
    };
    check_format_version(path, &metadata)?;
    Ok(metadata)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_file(name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let path = std::env::temp_dir().join(format!("conveyor-read-metadata-{}-{name}", std::process::id()));
        std::fs::write(&path, bytes).unwrap();
        path
    }

    fn with_header(header: &str) -> Vec<u8> {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes
    }

    #[test]
    fn reads_only_the_header_and_refuses_damaged_ones() {
        // A header promising tensor data that is not there: the metadata is still readable.
        let path = temp_file(
            "header-only",
            &with_header(r#"{"__metadata__":{"a":"1"},"w":{"dtype":"F32","shape":[1000],"data_offsets":[0,4000]}}"#),
        );
        assert_eq!(read_metadata(&path).unwrap(), BTreeMap::from([("a".to_string(), "1".to_string())]));
        std::fs::remove_file(&path).unwrap();
        let no_metadata = temp_file("no-metadata", &with_header("{}"));
        assert!(read_metadata(&no_metadata).unwrap().is_empty());
        std::fs::remove_file(&no_metadata).unwrap();
        for (name, bytes) in [
            ("short", b"abc".to_vec()),
            ("too-long", 1_000u64.to_le_bytes().iter().chain(b"{}").copied().collect()),
            ("not-json", with_header("not json")),
            ("not-strings", with_header(r#"{"__metadata__":{"a":1}}"#)),
            ("newer", with_header(r#"{"__metadata__":{"conveyor.format_version":"99"}}"#)),
        ] {
            let path = temp_file(name, &bytes);
            let error = read_metadata(&path).unwrap_err();
            assert!(matches!(error, Error::Checkpoint { .. }), "{name}: {error}");
            std::fs::remove_file(&path).unwrap();
        }
        let missing = std::env::temp_dir().join("conveyor-read-metadata-no-such-file");
        assert!(matches!(read_metadata(&missing).unwrap_err(), Error::Io { .. }));
    }
}
