"""What every stage shares and no stage owns: the run directory's layout (`layout`), the model a stage reads
(`sources`), the settings that change a result (`settings`), the run resolved once per stage (`resolved`), the stage
entry (`entry`: preflight, runtime, lock, signal flag, log), the lock (`lock`) and `hybrid-scale status` (`status`).
Nothing here imports a stage. `status` and what it imports (layout, lock) import no torch, so that it answers from a
login node in a fraction of a second."""
