"""FedDisk's and FedDiskAb's configs (see :mod:`fedplug.algorithms.feddisk`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from fedplug.analysis import Analysis, HistogramFigure, SetupSummary
from fedplug.components import ComponentConfig, PhaseCost

WEIGHT_NOTE = ("Each panel: the sample weights of all clients pooled, counts averaged over the runs (log scale; "
               "runs of one partition draw share their weights). Dashed line: weight 1 = an untrained D / no "
               "reweighting; a spike there means the weighting changes nothing.")
"""The caption of the weight histogram."""

WEIGHT_ANALYSIS = Analysis(
    setup_summaries=(SetupSummary("weights", prefix="sample_weight.", per_client=("q05", "median", "q95", "mean", "std")),),
    figures=(HistogramFigure("weight_histogram", summary="weights", title="sample weights of the setup phase",
                             value_label="sample weight", spread="std", reference=1.0,
                             reference_label="1 = no reweighting", note=WEIGHT_NOTE),),
)
"""What a study keeps of the setup report (:func:`~.weights.weight_summary`): the pooled
histogram and each client's 5% quantile, median, 95% quantile, mean and std as the record's
``weights``, and the figure ``weight_histogram`` of them."""


class SampleWeightConfig(ComponentConfig):
    """Fields shared by FedDisk and FedDiskAb: the discriminator and the normalisation."""

    analysis = WEIGHT_ANALYSIS

    classifier_hidden: int = Field(100, ge=1, le=4096)
    """Hidden ReLU units of the binary classifier D (default 100, paper 7.2.4)."""
    classifier_epochs: int = Field(500, ge=1, le=10_000)
    """Most epochs D trains for (default 500, the cap the paper puts on its MADEs). It
    stops earlier, once ``classifier_patience`` epochs in a row have not lowered its
    validation loss, and keeps the state of its best epoch (see
    :func:`~.weights.train_classifiers`). The paper trains D with SGD "until the loss is
    not significantly reduced" and gives no cap. On MNIST with feature noise (sigma 0.5,
    100 clients of 480 training images; FedDiskAb's D on five clients along the noise
    ramp, lr 0.01, batch 100) D stopped after 7 to 195 epochs, so the cap is a
    safeguard; a cap of 100 still bound on the noisiest and the cleanest clients."""
    classifier_patience: int = Field(5, ge=1, le=1000)
    """D stops after this many epochs without a lower validation loss (default 5)."""
    classifier_validation_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    """Share of each client's samples whose two vectors (global-like and local-like) are
    held out to early-stop D (default 0.2; at least one sample is held out and one kept).
    D trains on the rest; every sample, held out or not, gets a weight."""
    classifier_lr: float = Field(0.01, gt=0.0, le=10.0)
    """SGD learning rate of D (default 0.01, paper 7.2.4)."""
    classifier_batch_size: int = Field(100, ge=1, le=65536)
    """Mini-batch size of D's SGD."""
    normalisation: Literal["mean", "minmax"] = "mean"
    """How each client's raw ratios become weights: ``"mean"`` (default) scales them to
    mean 1 and clips to [clip_min, clip_max] (with ``keep_mean``, the scale is the one that
    leaves the clipped weights mean 1); ``"minmax"`` scales them to [0, 2] as the authors'
    code does. See docs/algorithms.md, "FedDisk", for why mean is the default."""
    keep_mean: bool = True
    """``"mean"`` weights keep mean 1 per client after clipping (default True): the loss
    ``mean(w * CE)`` then takes FedAvg's step. False: divide by the mean, then clip, as
    fedplug did before issue #23; the clip removes mass, so the weights' mean is below 1
    (0.77-0.89 in the FedDisk study) and every local step is that much shorter. Not used by
    ``"minmax"``."""
    clip_min: float = Field(0.0, ge=0.0, le=1.0)
    """Lower clip of mean-normalised weights (default 0: no lower clip)."""
    clip_max: float = Field(5.0, ge=1.0, le=1e6)
    """Upper clip of mean-normalised weights (default 5: no sample counts more than five
    average ones)."""
    cache_dir: str | None = None
    """Folder where computed weights are cached as ``<cache_key>.npz`` (default None:
    compute in memory every time)."""
    seed: int = Field(0, ge=0, le=2**32 - 1)
    """Seeds phase 1 (default 0): validation splits, MADE connectivity and initial
    weights, mini-batch order, classifier initialisation, FedDiskAb's pooled sample."""

    @model_validator(mode="before")
    @classmethod
    def _removed_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "classifier_tolerance" in data:
            error = PydanticCustomError(
                "removed_key",
                "was removed: D now trains until its validation loss stops improving; set "
                "classifier_patience (epochs without a lower validation loss, default 5) and "
                "classifier_epochs (the most epochs, default 500) instead",
            )
            raise ValidationError.from_exception_data(
                cls.__name__,
                [
                    InitErrorDetails(
                        type=error, loc=("classifier_tolerance",), input=data["classifier_tolerance"]
                    )
                ],
            )
        return data

    @model_validator(mode="after")
    def _check_clip_bounds(self) -> SampleWeightConfig:
        if self.clip_min >= self.clip_max:
            raise ValueError(
                f"clip_min ({self.clip_min}) must be smaller than clip_max ({self.clip_max})"
            )
        return self

    def setup_file(self, federation: Any) -> str | None:
        """``<cache_key>.npz``: phase 1's density ratios for ``federation``
        (:func:`~.cache.cache_path`), which the pipeline's setup stage computes once."""
        from fedplug.algorithms.feddisk.cache import cache_path

        return cache_path(".", federation, self).name

    def setup_file_cost(self, path: Any) -> PhaseCost:
        """The MADE phase's rounds and bytes, as the weights file keeps them."""
        from fedplug.algorithms.feddisk.cache import load_weights

        return load_weights(path, self).cost


class FedDiskConfig(SampleWeightConfig):
    """FedDisk (Nguyen, Wu, Chang 2024): CE weighted by p(x)/p_k(x) estimated with MADEs."""

    name: Literal["feddisk"] = "feddisk"
    made_hidden: int = Field(30, ge=1, le=4096)
    """Hidden units of every MADE (default 30, the paper's MNIST setting; 400 FEMNIST,
    50 chest X-ray)."""
    made_lr: float = Field(0.01, gt=0.0, le=1.0)
    """Adam learning rate of MADE training, local and in the FedAvg rounds."""
    made_batch_size: int = Field(200, ge=1, le=65536)
    """MADE mini-batch size."""
    made_max_epochs: int = Field(10, ge=1, le=1000)
    """Most epochs of a local MADE (default 10; the paper allows 500 with early stopping).
    On MNIST (10 clients x 5k) 10 epochs keep all of phase 1 near 25 CPU-seconds, and
    the validation NLL is within about 3% of its 30-epoch value."""
    patience: int = Field(2, ge=1, le=1000)
    """Local MADEs stop after this many epochs without a lower validation NLL."""
    global_rounds: int = Field(10, ge=1, le=1000)
    """Most FedAvg rounds of the global MADE (it stops earlier when the federated
    validation NLL rises)."""
    global_local_epochs: int = Field(1, ge=1, le=100)
    """Local epochs per client in each global MADE round."""
    made_features: Literal["predicted", "observed"] = "predicted"
    """What the classifier sees of a MADE: ``"predicted"`` (default) the network's output
    p(x_d = 1 | x_<d); ``"observed"`` the conditional probability of each observed value,
    p(x_d | x_<d). See the module docstring."""
    validation_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    """Share of each client's training data held out to early-stop the MADEs."""


class FedDiskAbConfig(SampleWeightConfig):
    """FedDiskAb (oracle ablation of FedDisk): D trained on raw local vs pooled inputs."""

    name: Literal["feddisk_ab"] = "feddisk_ab"
