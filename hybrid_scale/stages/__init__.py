"""Stages: plain functions over a config and a run directory."""
