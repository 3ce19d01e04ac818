//! Simulator tests: healthy cores pass, deliberately broken cores are caught.
