"""Isolation backends: each knows how to start a box that runs the guest agent, and tear it down."""
