//! A loaded model: the GGUF file, its validated shape and its bound tensors.

pub mod config;
pub mod weights;

use std::path::Path;
use std::sync::Arc;

pub use config::{AttentionKind, Config, ConfigError, RopeParams};
pub use weights::{IndexerReads, LayerWeights, WeightError, Weights};

use crate::gguf::{self, GgufError, TensorInfo};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Weights(#[from] WeightError),
}

/// The GGUF file (mapped or in memory), its config and its tensor bindings.
#[derive(Debug)]
pub struct Model {
    pub file: gguf::File,
    pub config: Config,
    pub weights: Weights,
    /// How the weights are drawn, for synthetic presets: a GPU backend generates them in its own
    /// memory instead of copying them. Without host data (`file.has_data()` false) it is the only
    /// way to get them.
    pub synthetic: Option<crate::synth::Synthetic>,
}

impl Model {
    pub fn open(path: impl AsRef<Path>) -> Result<Arc<Model>, ModelError> {
        Self::from_file(gguf::File::open(path)?)
    }

    pub fn from_file(file: gguf::File) -> Result<Arc<Model>, ModelError> {
        Self::from_file_synthetic(file, None)
    }

    /// A model with the recipe of its synthetic weights (see [`Model::synthetic`]).
    pub fn from_file_synthetic(
        file: gguf::File,
        synthetic: Option<crate::synth::Synthetic>,
    ) -> Result<Arc<Model>, ModelError> {
        let config = Config::from_gguf(&file)?;
        let weights = Weights::bind(&file, &config)?;
        Ok(Arc::new(Model { file, config, weights, synthetic }))
    }

    /// The bytes of a bound tensor.
    pub fn data(&self, t: &TensorInfo) -> &[u8] {
        self.file.tensor_data(t)
    }
}
