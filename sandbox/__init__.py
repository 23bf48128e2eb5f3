"""What a sandbox is and how one runs: spec, mount plan and its verification, backends, reaping."""
