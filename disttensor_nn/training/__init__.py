"""The training application built on the layer library: driver, data, checkpoints, tools."""
