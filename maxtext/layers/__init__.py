"""Neural-network layers (flax NNX). Parameters carry logical axis names in `logical_axes` metadata."""
