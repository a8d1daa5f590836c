"""Tests of service/ops/."""
