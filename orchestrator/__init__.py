"""The reference orchestrator: DiLoCo outer loop, sync-delta publication, artifact serving, the demo."""
