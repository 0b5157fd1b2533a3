"""Ahead-of-time compilation for TPU topologies without hardware: devices, memory report, executable files."""
