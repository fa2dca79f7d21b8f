"""What every stage shares and no stage owns: the run directory's layout (`layout`), its lock (`lock`) and
`hybrid-scale status` (`status`). Nothing here imports a stage, and nothing imports torch at module level, so
`status` answers from a login node in a fraction of a second."""
