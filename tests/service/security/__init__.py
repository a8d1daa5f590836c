"""Tests of service/security/."""
