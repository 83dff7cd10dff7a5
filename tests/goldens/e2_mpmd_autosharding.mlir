module @jit_model attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32, mm.num_devices = 8 : i64, mm.tasks = {layer1 = {axis_names = ["x", "y"], axis_sizes = [4, 1], devices = [0, 1, 2, 3], logical_axes = [["batch", "x"], ["model", "x"]]}, layer2 = {axis_names = ["x", "y"], axis_sizes = [4, 1], devices = [4, 5, 6, 7], logical_axes = [["batch", "x"], ["model", "x"]]}}} {
  sdy.mesh @mesh_layer1 = <["x"=4, "y"=1]>
  sdy.mesh @mesh_layer2 = <["x"=4, "y"=1]>
  func.func public @main(%arg0: tensor<8x8xi32> {mm.devices = [0, 1, 2, 3], mm.sharding = #sdy.sharding<@mesh_layer1, [{"x"}, {}]>}, %arg1: tensor<8x8xi32> {mm.devices = [4, 5, 6, 7], mm.sharding = #sdy.sharding<@mesh_layer2, [{}, {"x"}]>}, %arg2: tensor<8x8xi32> {mm.devices = [0, 1, 2, 3], mm.sharding = #sdy.sharding<@mesh_layer1, [{"x"}, {}]>}) -> (tensor<8x8xi32> {jax.result_info = "result"}) {
    %0 = stablehlo.custom_call @mm.fragment_call(%arg2, %arg0) {mm.fragment = @layer1_fwd} : (tensor<8x8xi32>, tensor<8x8xi32>) -> tensor<8x8xi32>
    %1 = stablehlo.custom_call @mm.transfer(%0) {mm.devices = [4, 5, 6, 7], mm.sharding = #sdy.sharding<@mesh_layer2, [{"x"}, {}]>} : (tensor<8x8xi32>) -> tensor<8x8xi32>
    %2 = stablehlo.custom_call @mm.fragment_call(%arg1, %1) {mm.fragment = @layer2_fwd} : (tensor<8x8xi32>, tensor<8x8xi32>) -> tensor<8x8xi32>
    return %2 : tensor<8x8xi32>
  }
  module @layer1_fwd attributes {mhlo.num_partitions = 4 : i32, mhlo.num_replicas = 1 : i32, mm.devices = [0, 1, 2, 3], mm.task = {name = "layer1", transpose_count = 0 : i64}} {
    sdy.mesh @mesh_layer1 = <["x"=4, "y"=1]>
    func.func public @main(%arg0: tensor<8x8xi32> {sdy.sharding = #sdy.sharding<@mesh_layer1, [{"x"}, {}]>}, %arg1: tensor<8x8xi32> {sdy.sharding = #sdy.sharding<@mesh_layer1, [{"x"}, {}]>}) -> (tensor<8x8xi32> {sdy.sharding = #sdy.sharding<@mesh_layer1, [{"x"}, {}]>}) {
      %0 = sdy.sharding_constraint %arg0 <@mesh_layer1, [{"x"}, {}]> : tensor<8x8xi32>
      %1 = sdy.sharding_constraint %arg1 <@mesh_layer1, [{"x"}, {}]> : tensor<8x8xi32>
      %2 = stablehlo.dot_general %0, %1, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x8xi32>, tensor<8x8xi32>) -> tensor<8x8xi32>
      return %2 : tensor<8x8xi32>
    }
  }
  module @layer2_fwd attributes {mhlo.num_partitions = 4 : i32, mhlo.num_replicas = 1 : i32, mm.devices = [4, 5, 6, 7], mm.task = {name = "layer2", transpose_count = 0 : i64}} {
    sdy.mesh @mesh_layer2 = <["x"=4, "y"=1]>
    func.func public @main(%arg0: tensor<8x8xi32> {sdy.sharding = #sdy.sharding<@mesh_layer2, [{}, {"x"}]>}, %arg1: tensor<8x8xi32> {sdy.sharding = #sdy.sharding<@mesh_layer2, [{"x"}, {}]>}) -> (tensor<8x8xi32> {sdy.sharding = #sdy.sharding<@mesh_layer2, [{"x"}, {}]>}) {
      %0 = sdy.sharding_constraint %arg0 <@mesh_layer2, [{}, {"x"}]> : tensor<8x8xi32>
      %1 = stablehlo.dot_general %arg1, %0, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x8xi32>, tensor<8x8xi32>) -> tensor<8x8xi32>
      %2 = sdy.sharding_constraint %1 <@mesh_layer2, [{"x"}, {}]> : tensor<8x8xi32>
      return %2 : tensor<8x8xi32>
    }
  }
}
