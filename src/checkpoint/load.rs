//! Reading checkpoints: resume an engine at any world size and stage (each rank reads only the
//! slices it now holds), consolidate the full weights into one file, inspect and verify.

use super::format::{file_crc, header_bytes, CrcWriter, SliceReader, TensorEntry};
use super::manifest::{Manifest, ModelDescription};
use super::{tensor_names, CheckpointError, LATEST_FILE, MANIFEST_FILE};
use crate::atomic_file::AtomicFile;
use crate::zero::{Engine, UnitModel};
use std::collections::BTreeMap;
use std::io::{BufWriter, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// The checkpoint directory `dir` names: itself when it holds a manifest, else the one its
/// `latest` file names.
pub fn resolve_dir(dir: &Path) -> Result<PathBuf, CheckpointError> {
    if dir.join(MANIFEST_FILE).exists() {
        return Ok(dir.to_path_buf());
    }
    let latest = dir.join(LATEST_FILE);
    let name = std::fs::read_to_string(&latest).map_err(|e| CheckpointError::NotFound {
        dir: dir.to_path_buf(),
        why: format!("no manifest.json and no readable `latest` file ({e})"),
    })?;
    let name = name.trim();
    if name.is_empty() || name.contains('/') || name.starts_with('.') {
        return Err(CheckpointError::NotFound {
            dir: dir.to_path_buf(),
            why: format!("`latest` names {name:?}, not a checkpoint directory"),
        });
    }
    Ok(dir.join(name))
}

/// The manifest of the checkpoint `dir` names ([`resolve_dir`]) and its directory.
pub fn load_manifest(dir: &Path) -> Result<(Manifest, PathBuf), CheckpointError> {
    let step_dir = resolve_dir(dir)?;
    Ok((Manifest::read(&step_dir)?, step_dir))
}

/// Files verified against the manifest's size and CRC-32, opened once each.
struct Files<'a> {
    dir: &'a Path,
    manifest: &'a Manifest,
    open: BTreeMap<usize, SliceReader>,
}

impl<'a> Files<'a> {
    fn new(dir: &'a Path, manifest: &'a Manifest) -> Self {
        Files {
            dir,
            manifest,
            open: BTreeMap::new(),
        }
    }

    fn get(&mut self, rank: usize) -> Result<&SliceReader, CheckpointError> {
        if !self.open.contains_key(&rank) {
            let entry = &self.manifest.files[rank];
            let path = self.dir.join(&entry.name);
            verify(&path, entry.bytes, entry.crc32)?;
            self.open.insert(rank, SliceReader::open(&path)?);
        }
        Ok(&self.open[&rank])
    }

    /// Elements `want` of tensor `which` (0 master, 1 exp_avg, 2 exp_avg_sq) of unit `unit`,
    /// gathered from every file whose range overlaps them.
    /// Master weights `want` of unit `unit`, in a new buffer.
    fn read_all(&mut self, unit: usize, want: Range<usize>) -> Result<Vec<f32>, CheckpointError> {
        let mut values = vec![0.0f32; want.len()];
        self.read(unit, 0, want, &mut values)?;
        Ok(values)
    }

    fn read(
        &mut self,
        unit: usize,
        which: usize,
        want: Range<usize>,
        out: &mut [f32],
    ) -> Result<(), CheckpointError> {
        let mut covered = 0;
        for rank in 0..self.manifest.files.len() {
            let [s, e] = self.manifest.files[rank].ranges[unit];
            let (lo, hi) = (s.max(want.start), e.min(want.end));
            if lo >= hi {
                continue;
            }
            let name = &tensor_names(unit)[which];
            self.get(rank)?
                .read(name, lo - s, &mut out[lo - want.start..hi - want.start])?;
            covered += hi - lo;
        }
        if covered != want.len() {
            return Err(CheckpointError::Manifest {
                path: self.dir.join(MANIFEST_FILE),
                what: format!(
                    "unit {unit}: the files cover {covered} of the elements {}..{}",
                    want.start, want.end
                ),
            });
        }
        Ok(())
    }
}

fn verify(path: &Path, bytes: u64, crc32: u32) -> Result<(), CheckpointError> {
    let (got_bytes, got) = file_crc(path)?;
    if got_bytes != bytes || got != crc32 {
        return Err(CheckpointError::Checksum {
            path: path.to_path_buf(),
            got,
            expected: crc32,
            bytes: got_bytes,
            expected_bytes: bytes,
        });
    }
    Ok(())
}

/// Resume `engine` from the checkpoint in `step_dir` (already read into `manifest`): every rank
/// reads the slices of master weights and Adam moments it now holds, whatever world size and
/// stage the checkpoint was saved at, then the ranks rebuild their parameters (a collective:
/// every rank calls it).
pub fn restore_engine<M: UnitModel>(
    engine: &mut Engine<'_, M>,
    manifest: &Manifest,
    step_dir: &Path,
    model: &ModelDescription,
) -> Result<(), CheckpointError> {
    if let Some(what) = manifest.model.difference(model) {
        return Err(CheckpointError::ModelMismatch {
            dir: step_dir.to_path_buf(),
            what,
        });
    }
    let mut files = Files::new(step_dir, manifest);
    let mut bufs: [Vec<f32>; 3] = Default::default();
    for unit in 0..engine.layout().num_units() {
        let want = engine.restored_range(unit);
        for (which, buf) in bufs.iter_mut().enumerate() {
            buf.clear();
            buf.resize(want.len(), 0.0);
            files.read(unit, which, want.clone(), buf)?;
        }
        engine.restore_unit(unit, &bufs[0], &bufs[1], &bufs[2])?;
    }
    engine.finish_restore(&manifest.counters)?;
    Ok(())
}

/// Writes the full model weights of the checkpoint `dir` names into one safetensors file with
/// the model's parameter names (what DeepSpeed's `zero_to_fp32.py` does), as F32 or BF16,
/// streaming one parameter at a time so memory stays near the largest parameter. Returns the
/// bytes written.
///
/// `out` is written under a temporary name and renamed over it only once whole and on disk: a
/// damaged checkpoint found half way, a full disk or a kill leaves what `out` held before. That
/// `out` is not inside or on a checkpoint is the caller's check
/// (`zerodp::outputs::check_outputs`, as `zerodp ckpt consolidate` does).
pub fn consolidate(dir: &Path, out: &Path, bf16: bool) -> Result<u64, CheckpointError> {
    let (manifest, step_dir) = load_manifest(dir)?;
    let mut files = Files::new(&step_dir, &manifest);
    let params: Vec<(usize, &super::manifest::ParamDescription)> = manifest
        .model
        .units
        .iter()
        .enumerate()
        .flat_map(|(u, unit)| unit.params.iter().map(move |p| (u, p)))
        .collect();
    let entries: Vec<TensorEntry> = params
        .iter()
        .map(|(_, p)| TensorEntry {
            name: p.name.clone(),
            shape: p.shape.clone(),
        })
        .collect();
    let (dtype, elem) = if bf16 { ("BF16", 2) } else { ("F32", 4) };
    let header = header_bytes(&entries, dtype, elem);
    let io = |source| CheckpointError::Io {
        path: out.to_path_buf(),
        source,
    };
    let file = AtomicFile::create(out).map_err(io)?;
    let mut w = CrcWriter::new(BufWriter::with_capacity(1 << 20, file));
    w.write_all(&(header.len() as u64).to_le_bytes())
        .map_err(io)?;
    w.write_all(&header).map_err(io)?;
    for ((u, p), e) in params.iter().zip(&entries) {
        let values = files.read_all(*u, p.offset..p.offset + e.len())?;
        write_values(&mut w, &values, bf16).map_err(io)?;
    }
    let (inner, bytes, _) = w.finish();
    let file = inner.into_inner().map_err(|e| io(e.into_error()))?;
    file.commit().map_err(io)?;
    Ok(bytes)
}

/// The full master weights of the checkpoint `dir` names, one flat f32 buffer per unit (each
/// checksum verified), with its manifest: what an export to another format starts from. Holds
/// the whole model in memory, unlike [`consolidate`], which streams.
pub fn read_params(dir: &Path) -> Result<(Manifest, Vec<Vec<f32>>), CheckpointError> {
    let (manifest, step_dir) = load_manifest(dir)?;
    let mut files = Files::new(&step_dir, &manifest);
    let params = (0..manifest.model.units.len())
        .map(|u| files.read_all(u, 0..manifest.model.units[u].numel))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((manifest, params))
}

/// F32 values as they are, or rounded to BF16.
fn write_values(w: &mut impl Write, values: &[f32], bf16: bool) -> std::io::Result<()> {
    if !bf16 {
        return w.write_all(bytemuck::cast_slice(values));
    }
    let narrow: Vec<u16> = values
        .iter()
        .map(|&x| half::bf16::from_f32(x).to_bits())
        .collect();
    w.write_all(bytemuck::cast_slice(&narrow))
}

/// What `zerodp ckpt inspect` reports.
#[derive(Debug, serde::Serialize)]
pub struct Inspection {
    pub dir: PathBuf,
    pub manifest: Manifest,
    /// Per file: `None` when its size and checksum match, else the problem.
    pub problems: Vec<(String, Option<String>)>,
}

/// Read the manifest of the checkpoint `dir` names and verify every file's size and checksum.
pub fn inspect(dir: &Path) -> Result<Inspection, CheckpointError> {
    let (manifest, step_dir) = load_manifest(dir)?;
    let problems = manifest
        .files
        .iter()
        .map(|f| {
            let path = step_dir.join(&f.name);
            let problem = verify(&path, f.bytes, f.crc32)
                .and_then(|()| SliceReader::open(&path).map(|_| ()))
                .err()
                .map(|e| e.to_string());
            (f.name.clone(), problem)
        })
        .collect();
    Ok(Inspection {
        dir: step_dir,
        manifest,
        problems,
    })
}
