"""What the user gives, validated once up front: config, tensor files, paths, user code, fixed bounds."""
