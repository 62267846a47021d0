"""Settings shared by the data-parallel and sharded tests: the GroupNorm variant of `tiny`
(BatchNorm's batch statistics differ by construction between 2 x 16 and 1 x 32 images), small
synthetic data."""

COMMON = [
    "model=tiny_gn",
    "data=synthetic",
    "data.num_train=160",
    "data.num_val=40",
    "data.image_size=16",
    "trainer.max_epochs=2",
    "trainer.num_workers=0",
    "trainer.progress_bar=false",
    "trainer.log_every_n_steps=1",
    "scheduler=none",
]
