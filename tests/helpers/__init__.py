"""What the tests share and are not tests themselves: helper modules, the torchrun probe scripts,
apex_l0.sh and preset_values.json."""
