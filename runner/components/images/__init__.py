"""Image datasets for classification: a `data` config section in, a `DataBundle` out.

Three sources, each a module:

* `data=synthetic` (synthetic.py): learnable images generated from a seed, nothing on disk.
* `data=cifar10` / `cifar100` (cifar.py): torchvision's python-pickle format, read without running
  what the files name, downloaded where `data.download` says so.
* `data=imagefolder` (folders.py): root/<split>/<class>/<image>, hidden files left out.

Each has a `build_*` (the config option's builder, `runner.config.options.SPECS`) and, where the
data is on disk, a `check_*` that the plan runs before anything is built or tracked. Anything a
user can fix (a wrong root, a missing split, no network for the download) raises `DataError`
whose message names the config key to change. torchvision is imported only by runs that read
CIFAR or an ImageFolder tree.
"""
