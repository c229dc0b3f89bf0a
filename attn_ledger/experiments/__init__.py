"""Experiments that answer one question each: score scale against Dh, mask polarity per API."""
