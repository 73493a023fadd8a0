// project.wgsl's sums through workgroup memory alone (an adapter without subgroup
// operations): trees over `red`.

// The sum of `v` over the workgroup, returned to every invocation (all of them call it).
fn group_sum(v: f32, lid: u32) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var k = GROUP / 2u; k > 0u; k >>= 1u) {
        if lid < k { red[lid] = red[lid] + red[lid + k]; }
        workgroupBarrier();
    }
    let total = red[0];
    workgroupBarrier();
    return total;
}

// Each row's total of `acc` over its `lanes` consecutive invocations into red at its first
// lane's `lid` (all invocations call it; the totals are visible to all on return).
fn lane_sums(acc: f32, lid: u32, lanes: u32) {
    red[lid] = acc;
    workgroupBarrier();
    for (var s = lanes / 2u; s > 0u; s >>= 1u) {
        if lid % lanes < s { red[lid] = red[lid] + red[lid + s]; }
        workgroupBarrier();
    }
}

@compute @workgroup_size(GROUP)
fn rows_main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    rows(wg, nw, lid);
}
