// RUN: mm-opt %s -p 'builtin.module(mm-import-gspmd)' --split-input-file --verify-diagnostics | filecheck %s

// Iota tile assignment with a replicated last tile dim: no device_ids.
// CHECK-LABEL: module @iota
// CHECK-NEXT{LITERAL}: sdy.mesh @mesh_0 = <["d0"=2, "d1"=4]>
// CHECK-NEXT: func.func public @main
// CHECK-SAME{LITERAL}: %arg0: tensor<8x8xf32> {sdy.sharding = #sdy.sharding<@mesh_0, [{"d0"}, {}]>}
// CHECK-SAME{LITERAL}: -> (tensor<8x8xf32> {jax.result_info = "result", sdy.sharding = #sdy.sharding<@mesh_0, [{"d0"}, {"d1"}]>})
// CHECK-NOT: mhlo.sharding
module @iota attributes {mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<8x8xf32> {mhlo.sharding = "{devices=[2,1,4]<=[8] last_tile_dim_replicate}"}) -> (tensor<8x8xf32> {jax.result_info = "result", mhlo.sharding = "{devices=[2,4]<=[8]}"}) {
    %0 = stablehlo.sine %arg0 : tensor<8x8xf32>
    return %0 : tensor<8x8xf32>
  }
}

// -----

// Transposed iota: device order becomes device_ids; the constraint becomes sdy.
// CHECK-LABEL: module @transposed
// CHECK-NEXT{LITERAL}: sdy.mesh @mesh_0 = <["d0"=8], device_ids=[0, 4, 1, 5, 2, 6, 3, 7]>
// CHECK-NEXT{LITERAL}: sdy.mesh @mesh_1 = <["d0"=4, "d1"=2], device_ids=[0, 4, 1, 5, 2, 6, 3, 7]>
// CHECK-NEXT: func.func public @main
// CHECK-SAME{LITERAL}: %arg0: tensor<8x8xf32> {sdy.sharding = #sdy.sharding<@mesh_0, [{}, {"d0"}]>}
// CHECK-NEXT{LITERAL}: %0 = sdy.sharding_constraint %arg0 <@mesh_1, [{"d0"}, {"d1"}]> : tensor<8x8xf32>
// CHECK-NEXT: stablehlo.cosine %0
// CHECK-NOT: @Sharding
module @transposed attributes {mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<8x8xf32> {mhlo.sharding = "{devices=[1,8]<=[2,4]T(1,0)}"}) -> tensor<8x8xf32> {
    %0 = stablehlo.custom_call @Sharding(%arg0) {backend_config = "", mhlo.sharding = "{devices=[4,2]<=[2,4]T(1,0)}"} : (tensor<8x8xf32>) -> tensor<8x8xf32>
    %1 = stablehlo.cosine %0 : tensor<8x8xf32>
    return %1 : tensor<8x8xf32>
  }
}

// -----

// Explicit device list; two shardings with the same tile assignment share a mesh.
// CHECK-LABEL: module @explicit
// CHECK-NEXT{LITERAL}: sdy.mesh @mesh_0 = <["d0"=2, "d1"=2], device_ids=[0, 2, 1, 3]>
// CHECK-NOT: sdy.mesh
// CHECK-NEXT: func.func public @main
// CHECK-SAME{LITERAL}: %arg0: tensor<8x8xf32> {sdy.sharding = #sdy.sharding<@mesh_0, [{"d0"}, {"d1"}]>}
// CHECK-SAME{LITERAL}: %arg1: tensor<8x8xf32> {sdy.sharding = #sdy.sharding<@mesh_0, [{"d0"}, {}]>}
module @explicit attributes {mhlo.num_partitions = 4 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<8x8xf32> {mhlo.sharding = "{devices=[2,2]0,2,1,3}"}, %arg1: tensor<8x8xf32> {mhlo.sharding = "{devices=[2,1,2]0,2,1,3 last_tile_dims={replicated}}"}) -> tensor<8x8xf32> {
    %0 = stablehlo.add %arg0, %arg1 : tensor<8x8xf32>
    return %0 : tensor<8x8xf32>
  }
}

// -----

// Replicated next to a tiled sharding reuses the tiled mesh; on its own it gets an empty mesh.
// CHECK-LABEL: module @replicated
// CHECK-NEXT{LITERAL}: sdy.mesh @mesh_0 = <["d0"=8]>
// CHECK-NEXT: func.func public @main
// CHECK-SAME{LITERAL}: %arg0: tensor<8x8xf32> {sdy.sharding = #sdy.sharding<@mesh_0, [{}, {}]>}
// CHECK-SAME{LITERAL}: %arg1: tensor<8xf32> {sdy.sharding = #sdy.sharding<@mesh_0, [{"d0"}]>}
// CHECK-SAME{LITERAL}: -> (tensor<8x8xf32> {sdy.sharding = #sdy.sharding<@mesh_0, [{}, {}]>})
module @replicated attributes {mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<8x8xf32> {mhlo.sharding = "{replicated}"}, %arg1: tensor<8xf32> {mhlo.sharding = "{devices=[8]<=[8]}"}) -> (tensor<8x8xf32> {mhlo.sharding = "{replicated}"}) {
    return %arg0 : tensor<8x8xf32>
  }
}

// -----

// CHECK-LABEL: module @replicated_only
// CHECK-NEXT{LITERAL}: sdy.mesh @empty_mesh = <[]>
// CHECK-NEXT{LITERAL}: func.func public @main(%arg0: tensor<8x8xf32> {sdy.sharding = #sdy.sharding<@empty_mesh, [{}, {}]>})
module @replicated_only attributes {mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<8x8xf32> {mhlo.sharding = "{replicated}"}) -> tensor<8x8xf32> {
    return %arg0 : tensor<8x8xf32>
  }
}

// -----

// @Sharding with unspecified_dims: the unspecified dimension is open.
// CHECK-LABEL: module @constraint
// CHECK-NEXT{LITERAL}: sdy.mesh @mesh_0 = <["d0"=2, "d1"=4]>
// CHECK-NEXT: func.func public @main
// CHECK-NEXT{LITERAL}: %0 = sdy.sharding_constraint %arg0 <@mesh_0, [{?}, {"d0"}]> : tensor<8x8xf32>
// CHECK-NEXT{LITERAL}: %1 = sdy.sharding_constraint %0 <@mesh_0, [{}, {}]> : tensor<8x8xf32>
// CHECK-NEXT: return %1
module @constraint attributes {mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<8x8xf32>) -> tensor<8x8xf32> {
    %0 = stablehlo.custom_call @Sharding(%arg0) {backend_config = "unspecified_dims=[0]", mhlo.sharding = "{devices=[1,2,4]<=[8] last_tile_dim_replicate}"} : (tensor<8x8xf32>) -> tensor<8x8xf32>
    %1 = stablehlo.custom_call @Sharding(%0) {backend_config = "", mhlo.sharding = "{replicated}"} : (tensor<8x8xf32>) -> tensor<8x8xf32>
    return %1 : tensor<8x8xf32>
  }
}

// -----

// Maximal sharding on a multi-result op applies to every result.
// CHECK-LABEL: module @maximal
// CHECK-NEXT{LITERAL}: sdy.mesh @mesh_0 = <["d0"=2, "d1"=4]>
// CHECK-NEXT{LITERAL}: sdy.mesh @maximal_mesh_3 = <[], device_ids=[3]>
// CHECK: stablehlo.custom_call @xla_ffi_python_cpu_callback
// CHECK-SAME{LITERAL}: sdy.sharding = #sdy.sharding_per_value<[<@maximal_mesh_3, []>, <@maximal_mesh_3, []>]>
// CHECK-NOT: mhlo.sharding
module @maximal attributes {mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: !stablehlo.token, %arg1: tensor<8x8xf32> {mhlo.sharding = "{devices=[2,1,4]<=[8] last_tile_dim_replicate}"}) -> (!stablehlo.token, tensor<8x8xf32>) {
    %0:2 = stablehlo.custom_call @xla_ffi_python_cpu_callback(%arg0, %arg1) {has_side_effect = true, mhlo.sharding = "{maximal device=3}"} : (!stablehlo.token, tensor<8x8xf32>) -> (!stablehlo.token, tensor<8x8xf32>)
    return %0#0, %0#1 : !stablehlo.token, tensor<8x8xf32>
  }
}

// -----

// Tuple sharding: one element per result.
// CHECK-LABEL: module @tuple
// CHECK-NEXT{LITERAL}: sdy.mesh @mesh_0 = <["d0"=4, "d1"=2]>
// CHECK-NEXT{LITERAL}: sdy.mesh @maximal_mesh_0 = <[], device_ids=[0]>
// CHECK: stablehlo.custom_call @foo(%arg0)
// CHECK-SAME{LITERAL}: {sdy.sharding = #sdy.sharding_per_value<[<@mesh_0, [{"d0"}, {}]>, <@maximal_mesh_0, []>]>}
module @tuple attributes {mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<8x8xf32>) -> (tensor<8x8xf32>, tensor<8xf32>) {
    %0:2 = stablehlo.custom_call @foo(%arg0) {mhlo.sharding = "{{devices=[4,1,2]<=[8] last_tile_dim_replicate}, {maximal device=0}}"} : (tensor<8x8xf32>) -> (tensor<8x8xf32>, tensor<8xf32>)
    return %0#0, %0#1 : tensor<8x8xf32>, tensor<8xf32>
  }
}

// -----

// A module already in sdy form passes through unchanged.
// CHECK-LABEL: module @sdy_form
// CHECK-NEXT{LITERAL}: sdy.mesh @mesh = <["a"=2, "b"=4]>
// CHECK-NEXT{LITERAL}: func.func public @main(%arg0: tensor<8x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"a"}, {}]>}) -> tensor<8x8xf32> {
// CHECK-NEXT{LITERAL}: %0 = sdy.sharding_constraint %arg0 <@mesh, [{}, {"b"}]> : tensor<8x8xf32>
// CHECK-NEXT: return %0
module @sdy_form attributes {mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["a"=2, "b"=4]>
  func.func public @main(%arg0: tensor<8x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"a"}, {}]>}) -> tensor<8x8xf32> {
    %0 = sdy.sharding_constraint %arg0 <@mesh, [{}, {"b"}]> : tensor<8x8xf32>
    return %0 : tensor<8x8xf32>
  }
}

// -----

module @shard_map attributes {mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<8x8xf32>) -> tensor<1x8xf32> {
    // expected-error@+1 {{shard_map in GSPMD form (custom_call @SPMDFullToShardShape) is not supported; export the program with Shardy}}
    %0 = stablehlo.custom_call @SPMDFullToShardShape(%arg0) {mhlo.sharding = "{manual}"} : (tensor<8x8xf32>) -> tensor<1x8xf32>
    return %0 : tensor<1x8xf32>
  }
}

// -----

module @manual attributes {mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32} {
  // expected-error@+1 {{manual GSPMD shardings (shard_map in GSPMD form) are not supported}}
  func.func public @main(%arg0: tensor<8x8xf32> {mhlo.sharding = "{devices=[2,1,4]<=[8] last_tile_dims={manual}}"}) -> tensor<8x8xf32> {
    return %arg0 : tensor<8x8xf32>
  }
}

// -----

module @mixed_counts attributes {mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<8x8xf32> {mhlo.sharding = "{devices=[2,4]<=[8]}"}) -> tensor<8x8xf32> {
    // expected-error@+1 {{GSPMD shardings over different device counts in one module: 8 and 4 devices}}
    %0 = stablehlo.custom_call @Sharding(%arg0) {mhlo.sharding = "{devices=[4,1]<=[4]}"} : (tensor<8x8xf32>) -> tensor<8x8xf32>
    return %0 : tensor<8x8xf32>
  }
}

// -----

module @malformed attributes {mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<8x8xf32>) -> tensor<8x8xf32> {
    // expected-error@+1 {{cannot parse GSPMD sharding "{devices=[2,4]<=[4]}" on custom_call @Sharding}}
    %0 = stablehlo.custom_call @Sharding(%arg0) {mhlo.sharding = "{devices=[2,4]<=[4]}"} : (tensor<8x8xf32>) -> tensor<8x8xf32>
    return %0 : tensor<8x8xf32>
  }
}

// -----

module @rank_mismatch attributes {mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<8x8xf32>) -> tensor<8x8xf32> {
    // expected-error@+1 {{GSPMD sharding with 1 tiled dimensions on a value of type tensor<8x8xf32>}}
    %0 = stablehlo.sine %arg0 {mhlo.sharding = "{devices=[8]<=[8]}"} : tensor<8x8xf32>
    return %0 : tensor<8x8xf32>
  }
}

// -----

module @tuple_count attributes {mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<8x8xf32>) -> tensor<8x8xf32> {
    // expected-error@+1 {{tuple sharding with 2 elements on an op with 1 results}}
    %0 = stablehlo.sine %arg0 {mhlo.sharding = "{{replicated}, {replicated}}"} : tensor<8x8xf32>
    return %0 : tensor<8x8xf32>
  }
}
